"""serve_bench's servers and clients: a server subprocess on 127.0.0.1, its loads.

A load is ``len(prompts)`` streamed /v1/completions requests sent at once (a
thread each). It is answered when every request streams ``max_tokens`` tokens
within ``timeout`` seconds; otherwise ``LoadFailed`` says how: the server died
(its process exited, or its /health turned unavailable, as mlx_lm.server's does
when its generation thread dies), a request timed out, or a request failed.
"""

import json
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

HOST = "127.0.0.1"  # the only host this benchmark talks to
MB = 1e6
# The line of a server log that says why it failed (the last one wins).
ERROR_LINE = re.compile(r"error|exception|died|killed|out of memory", re.IGNORECASE)


class LoadFailed(Exception):
    """A load the server did not answer; ``kind``: died, timed out, failed, did not start."""

    def __init__(self, kind: str, error: str):
        super().__init__(f"{kind}: {error}")
        self.kind, self.error = kind, error


def unwind_on_sigterm():
    """SIGTERM raises KeyboardInterrupt, so a benchmark killed that way unwinds
    and stops every server it started."""
    signal.signal(signal.SIGTERM, _interrupt)


def _interrupt(*_):
    raise KeyboardInterrupt


def _die_with_parent():  # Linux: a server outlives no killed benchmark
    try:
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def log_error(text: str) -> str:
    """The line of a server log that says why it stopped answering."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    found = next((line for line in reversed(lines) if ERROR_LINE.search(line)), None)
    return (found or (lines[-1] if lines else "no output"))[:300]


class Server:
    """A server subprocess on 127.0.0.1 (a free port); ``stop`` always ends it."""

    def __init__(self, argv, log: Path):
        with socket.socket() as s:
            s.bind((HOST, 0))
            self.port = s.getsockname()[1]
        self.log = log
        self._out = open(log, "w")
        self.proc = subprocess.Popen([sys.executable, *argv, "--host", HOST, "--port",
                                      str(self.port)], stdout=self._out,
                                     stderr=subprocess.STDOUT, preexec_fn=_die_with_parent)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()

    def url(self, path):
        return f"http://{HOST}:{self.port}{path}"

    def healthy(self, timeout=10):
        """True (200), False (it answered otherwise), None (no answer in time)."""
        try:
            with urllib.request.urlopen(self.url("/health"), timeout=timeout) as r:
                return r.status == 200
        except urllib.error.HTTPError:
            return False
        except OSError:
            return None

    def wait_ready(self, timeout):
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise LoadFailed("did not start", f"exited ({self.proc.returncode}): "
                                 f"{self.error()}")
            if self.healthy(timeout=2):
                return
            time.sleep(0.25)
        raise LoadFailed("did not start", f"no /health in {timeout:.0f} s: {self.error()}")

    def error(self):
        return log_error(self.log.read_text()) if self.log.exists() else "no log"

    def status_mb(self, key):  # VmHWM / VmRSS of the server process, in MB (None: gone)
        try:
            status = Path(f"/proc/{self.proc.pid}/status").read_text()
        except OSError:
            return None
        line = next((l for l in status.splitlines() if l.startswith(key + ":")), None)
        return None if line is None else int(line.split()[1]) * 1024 / MB

    def reset_peak(self):  # Linux >= 4.0: VmHWM restarts from the current RSS
        try:
            Path(f"/proc/{self.proc.pid}/clear_refs").write_text("5")
        except OSError:  # then the serving peak is the process's
            pass

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=15)
        self._out.close()


class GpuSampler(threading.Thread):
    """nvidia-smi's memory.used (MB, all GPUs): the most since ``reset``, above ``base``
    (its value before the server started)."""

    def __init__(self):
        super().__init__(daemon=True)
        self.base = self.peak = self.used()
        self._done = threading.Event()

    @staticmethod
    def used():
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,"
                              "nounits"], capture_output=True, text=True, timeout=10).stdout
        return sum(float(v) for v in out.split()) * 2**20 / MB

    def run(self):
        while not self._done.wait(0.2):
            self.peak = max(self.peak, self.used())

    def reset(self):
        self.peak = self.used()

    def above_base(self):
        return max(self.peak, self.used()) - self.base

    def finish(self):
        self._done.set()
        if self.is_alive():
            self.join()


class Served:
    """One config's server while open (started, ready), and its loads measured."""

    def __init__(self, name, argv, log: Path, start_timeout: float):
        self.sampler = GpuSampler() if shutil.which("nvidia-smi") else None  # before the fork
        self.server = Server(argv, log)
        print(f"server config={name} pid={self.server.proc.pid} port={self.server.port}",
              flush=True)
        try:
            if self.sampler:  # a thread only once the server is forked (preexec_fn)
                self.sampler.start()
            self.server.wait_ready(start_timeout)
        except BaseException:
            self.close()
            raise
        self.ready_mb = self.server.status_mb("VmRSS")
        self.process_peak_mb = self.ready_mb

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self):
        self.server.stop()
        if self.sampler:
            self.sampler.finish()

    def _note_peak(self, mb):
        if mb is not None:
            self.process_peak_mb = max(self.process_peak_mb or 0, mb)

    def load(self, prompts, max_tokens, bias, timeout):
        """Answer ``prompts`` at once: the load's measures, or LoadFailed."""
        srv = self.server
        self._note_peak(srv.status_mb("VmHWM"))
        srv.reset_peak()
        if self.sampler:
            self.sampler.reset()
        results = run_load(srv, prompts, max_tokens, bias, timeout)
        serve_peak = srv.status_mb("VmHWM")
        self._note_peak(serve_peak)
        gpu = self.sampler.above_base() if self.sampler else None
        return measure(results, self.ready_mb, self.process_peak_mb, serve_peak, gpu)


def stream_completion(url, prompt, max_tokens, bias, timeout):
    """One streamed /v1/completions request: times (monotonic) and usage."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}, "logit_bias": bias}
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    sent = time.monotonic()
    first, usage = None, None
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            for raw in r:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue  # keep-alives during prefill, the end
                chunk = json.loads(line[6:])
                if first is None and any(c.get("text") for c in chunk.get("choices", [])):
                    first = time.monotonic()
                usage = chunk.get("usage") or usage
    except urllib.error.HTTPError as e:
        raise RuntimeError(f"HTTP {e.code}: {e.read()[:200].decode(errors='replace')}") from e
    return {"sent": sent, "first": first, "done": time.monotonic(), "usage": usage}


def _watch(server: Server, threads, timeout, poll=2.0):
    """Wait for the clients; LoadFailed as soon as the server dies or time is up."""
    deadline = time.monotonic() + timeout
    while (waiting := next((t for t in threads if t.is_alive()), None)) is not None:
        waiting.join(poll)
        _check_alive(server)
        if time.monotonic() > deadline and any(t.is_alive() for t in threads):
            raise LoadFailed("timed out", f"a request took over {timeout:.0f} s")


def _check_alive(server: Server, wait: float = 0.0):
    """LoadFailed("died") if the server process ended (waiting up to ``wait``
    seconds for it) or its /health fails."""
    try:
        server.proc.wait(wait)
    except subprocess.TimeoutExpired:
        pass
    if server.proc.poll() is not None:
        raise LoadFailed("died", f"exited ({server.proc.returncode}): {server.error()}")
    if server.healthy() is False:
        raise LoadFailed("died", f"/health unavailable: {server.error()}")


def run_load(server: Server, prompts, max_tokens, bias, timeout):
    """All prompts at once, one thread each: results in prompt order, or LoadFailed
    (the server stopped first, so every client returns)."""
    results, errors = [None] * len(prompts), {}
    start = threading.Barrier(len(prompts))

    def client(i):
        try:
            start.wait(timeout=30)
            # _watch ends the load at ``timeout``; the socket's own limit is a backstop
            results[i] = stream_completion(server.url("/v1/completions"), prompts[i],
                                           max_tokens, bias, timeout + 30)
        except Exception as e:  # noqa: BLE001 (judged below)
            errors[i] = e

    threads = [threading.Thread(target=client, args=(i,), daemon=True)
               for i in range(len(prompts))]
    for t in threads:
        t.start()
    try:
        _watch(server, threads, timeout)
        if errors:  # a dying server closes its connections before its process ends
            _check_alive(server, wait=5.0)
    except LoadFailed:
        server.stop()
        for t in threads:
            t.join(30)
        raise
    for i, r in enumerate(results):
        if i in errors:
            raise LoadFailed("failed", f"client {i}: {errors[i]!r}; server: {server.error()}")
        done = (r["usage"] or {}).get("completion_tokens", 0)
        if done != max_tokens or r["first"] is None:
            raise LoadFailed("failed", f"client {i}: {done} of {max_tokens} tokens streamed")
    return results


def measure(results, ready, peak, serve_peak, gpu):
    usage = [r["usage"] for r in results]
    h2o = [u["h2o"] for u in usage if u.get("h2o")]
    gen = sum(u["completion_tokens"] for u in usage)
    wall = max(r["done"] for r in results) - min(r["sent"] for r in results)
    ttft = [r["first"] - r["sent"] for r in results]
    rec = {"agg_tok_s": gen / wall, "ttft_med_s": statistics.median(ttft),
           "ttft_max_s": max(ttft), "wall_s": wall, "completion_tokens": gen,
           "decode_tok_s": sum((u["completion_tokens"] - 1) / (r["done"] - r["first"])
                               for u, r in zip(usage, results)),
           "prompt_tokens": statistics.median(u["prompt_tokens"] for u in usage),
           "cached_tokens": sum(u.get("prompt_tokens_details", {}).get("cached_tokens", 0)
                                for u in usage),
           "rss_ready_mb": ready, "peak_rss_mb": peak, "serve_peak_rss_mb": serve_peak,
           "gpu_peak_mb": gpu}
    if h2o:
        rec.update(kv_mb=statistics.median(h["kv_bytes"] for h in h2o) / MB,
                   kvcache_mb=statistics.median(h["kvcache_allocated_bytes"] for h in h2o)
                   / MB,
                   tokens_kept=max(h["tokens_kept"] for h in h2o),
                   tokens_seen=max(h["tokens_seen"] for h in h2o),
                   batch_rows=max(h["batch_rows"] for h in h2o), h2o=h2o[0])
    return rec
