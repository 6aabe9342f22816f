"""Serving benchmark: stock mlx_lm.server (KVCache) vs mlx-h2o serve at KV budgets.

    python benchmarks/serve_bench.py [--clients 4] [--prompt-tokens 1024] [--max-tokens 64]
        [--budgets 256 1024] [--rounds 2] [--model PATH | --random qwen3-8b [--random-bits 4]]

A trial starts one server on 127.0.0.1 (a free port), waits for /health,
warms it up with one short request, sends ``--clients`` streamed
/v1/completions requests at once (a thread each; ``--prompt-tokens`` of
shuffled prose, distinct per client and round, greedy, end-of-sequence
tokens banned by ``logit_bias`` so each request generates ``--max-tokens``),
then stops the server. Measured: aggregate generated tok/s (all tokens over
first send to last reply), time to first streamed token (median, max), KV
bytes a request holds (``usage.h2o.kv_bytes``; stock: the
``kvcache_allocated_bytes`` that H2O reports for the same prompts, what mlx-lm's
KVCache allocates), the server's peak RSS (/proc VmHWM: over its life, and from
the warm-up's end) and, where nvidia-smi exists, the most GPU memory used
during the trial above what was used before the server started. Configs
rotate within each of ``--rounds`` rounds; ratios to stock pair trials of a
round. Without --model both serve the packaged SmolLM2 (``--h2o-args
"--h2o-layer-budget auto"``: mlx-h2o with its layer profile); ``--random NAME`` builds a random-weight model with NAME's
shapes (mlx_h2o.eval.bench.RANDOM_CONFIGS) in a temporary folder with
``--tokenizer``'s files (default: the packaged SmolLM2's). Prints a config
header, a key=value line per trial, a summary table and a final JSON line.
Every server started is stopped, on errors, Ctrl-C and SIGTERM too.
"""

import argparse
import json
import os
import platform
import random
import re
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

HOST = "127.0.0.1"  # the only host this script talks to
PROSE = Path(__file__).resolve().parents[1] / "tests" / "data" / "python_docs_prose.txt"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
MB = 1e6


# --- servers -----------------------------------------------------------------------------------
def _die_with_parent():  # Linux: a server outlives no killed benchmark
    try:
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


class Server:
    """A server subprocess on 127.0.0.1; a context manager that always stops it."""

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

    def wait_ready(self, timeout):
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited ({self.proc.returncode}): {self.tail()}")
            try:
                with urllib.request.urlopen(self.url("/health"), timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.25)
        raise RuntimeError(f"server not ready in {timeout} s: {self.tail()}")

    def status_mb(self, key):  # VmHWM / VmRSS of the server process, in MB
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024 / MB
        return None

    def reset_peak(self):  # Linux >= 4.0: VmHWM restarts from the current RSS
        try:
            Path(f"/proc/{self.proc.pid}/clear_refs").write_text("5")
        except OSError:  # then the serving peak is the process's
            pass

    def tail(self, n=1500):
        return self.log.read_text()[-n:] if self.log.exists() else ""

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
    """Peak of nvidia-smi's memory.used (MB, all GPUs) above its value at start."""

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

    def finish(self):
        self._done.set()
        self.join()
        return self.peak - self.base


# --- clients -----------------------------------------------------------------------------------
def stream_completion(url, prompt, max_tokens, bias, timeout):
    """One streamed /v1/completions request: times (monotonic) and usage."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}, "logit_bias": bias}
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    sent = time.monotonic()
    first, usage = None, None
    with urllib.request.urlopen(req, timeout=timeout) as r:
        for raw in r:
            if time.monotonic() - sent > timeout:
                raise TimeoutError(f"request took over {timeout} s")
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue  # keep-alives during prefill, the end
            chunk = json.loads(line[6:])
            if first is None and any(c.get("text") for c in chunk.get("choices", [])):
                first = time.monotonic()
            usage = chunk.get("usage") or usage
    return {"sent": sent, "first": first, "done": time.monotonic(), "usage": usage}


def run_clients(url, prompts, max_tokens, bias, timeout):
    """All prompts at once, one thread each; results in prompt order."""
    results, errors = [None] * len(prompts), []
    start = threading.Barrier(len(prompts))

    def client(i):
        try:
            start.wait(timeout=30)
            results[i] = stream_completion(url, prompts[i], max_tokens, bias, timeout)
        except Exception as e:  # noqa: BLE001 (raised below)
            errors.append(f"client {i}: {e!r}")

    threads = [threading.Thread(target=client, args=(i,), daemon=True)
               for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 60)
    if errors or any(r is None or r["first"] is None for r in results):
        raise RuntimeError(f"requests failed: {errors or 'no token streamed'}")
    return results


def make_prompts(tokenizer, lengths, seed):
    """A prompt of each length from the prose's sentences, shuffled; no two share
    their first token (so no prompt reuses another's cached prefix)."""
    rng = random.Random(seed)
    sentences = PROSE.read_text().replace("\n", " ").split(". ")
    words = sorted({w for w in re.findall(r"[A-Za-z]+", " ".join(sentences))})
    rng.shuffle(words)
    leads, firsts = [], set()
    for w in words:
        first = tokenizer.encode(w, add_special_tokens=False).ids[0]
        if first not in firsts and len(leads) < len(lengths):
            leads.append(w)
            firsts.add(first)
    if len(leads) < len(lengths):
        raise ValueError(f"{len(lengths)} prompts need as many distinct first tokens")
    prompts = []
    for lead, n in zip(leads, lengths):
        ids = tokenizer.encode(lead + ":", add_special_tokens=False).ids
        while len(ids) < n:
            rng.shuffle(sentences)
            ids += tokenizer.encode(" " + ". ".join(sentences), add_special_tokens=False).ids
        prompts.append(tokenizer.decode(ids[:n]))
    return prompts


# --- the model -----------------------------------------------------------------------------------
def save_random_model(out: Path, name: str, bits: int, tokenizer_dir: Path) -> Path:
    """A random-weight model with ``name``'s shapes as an mlx-lm folder, with
    ``tokenizer_dir``'s tokenizer. Output rows past the tokenizer's vocabulary
    are zero, so greedy decoding picks only ids the tokenizer can decode."""
    import mlx.core as mx
    import mlx.nn as nn
    from mlx_lm.utils import save_config, save_model
    from tokenizers import Tokenizer

    from mlx_h2o.eval.bench import RANDOM_CONFIGS, random_model

    if name not in RANDOM_CONFIGS:
        raise ValueError(f"--random {name}: use one of {sorted(RANDOM_CONFIGS)}")
    config = dict(RANDOM_CONFIGS[name])
    vocab = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json")).get_vocab_size()
    if vocab > config["vocab_size"]:
        raise ValueError(f"the tokenizer's {vocab} ids do not fit {name}'s vocabulary")
    model = random_model(name)  # bfloat16
    head = model.lm_head if "lm_head" in model else model.model.embed_tokens
    weight = head.weight
    weight[vocab:] = 0  # (vocab_size, hidden): logits of undecodable ids stay 0
    head.weight = weight
    if bits:
        nn.quantize(model, group_size=64, bits=bits)
        config["quantization"] = {"group_size": 64, "bits": bits}
    mx.eval(model.parameters())
    save_model(out, model)
    if (tokenizer_dir / "config.json").exists():  # the tokenizer's model: its special ids
        source = json.loads((tokenizer_dir / "config.json").read_text())
        config.update({k: source[k] for k in ("bos_token_id", "eos_token_id") if k in source})
    save_config(config, out / "config.json")
    for f in TOKENIZER_FILES:
        if (tokenizer_dir / f).exists():
            shutil.copy(tokenizer_dir / f, out / f)
    tok_config = json.loads((out / "tokenizer_config.json").read_text())
    tok_config["tokenizer_class"] = "PreTrainedTokenizerFast"  # transformers 4 and 5
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2))
    return out


def model_info(path: Path):
    """(tokenizer, banned end-of-sequence ids, layers, KV heads) of a model folder."""
    from tokenizers import Tokenizer

    config = json.loads((path / "config.json").read_text())
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    eos = config.get("eos_token_id")
    ids = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    tok_config = json.loads((path / "tokenizer_config.json").read_text())
    eos_token = tok_config.get("eos_token")
    eos_token = eos_token.get("content") if isinstance(eos_token, dict) else eos_token
    if eos_token and tok.token_to_id(eos_token) is not None:
        ids.add(tok.token_to_id(eos_token))
    kv_heads = config.get("num_key_value_heads", config["num_attention_heads"])
    return tok, sorted(ids), config["num_hidden_layers"], kv_heads


def kv_bound(h2o, budget, layers, kv_heads):
    """Bytes a request may hold at ``budget`` tokens a layer: K/V (the per-token
    size from ``kvcache_bytes``, KVCache's for exactly the tokens seen) + 12 a head."""
    token_bytes = h2o["kvcache_bytes"] / (layers * h2o["tokens_seen"])
    return budget * layers * (token_bytes + 12 * kv_heads)


# --- trials and summary -----------------------------------------------------------------------
def trial(config, prompts, warm, bias, args, log: Path):
    sampler = GpuSampler() if shutil.which("nvidia-smi") else None  # before the server
    with Server(config["argv"], log) as srv:
        print(f"server config={config['name']} pid={srv.proc.pid} port={srv.port}", flush=True)
        if sampler:  # a thread only once the server is forked (preexec_fn)
            sampler.start()
        try:
            srv.wait_ready(args.start_timeout)
            ready = srv.status_mb("VmRSS")
            stream_completion(srv.url("/v1/completions"), warm, 8, bias, args.timeout)
            start_peak = srv.status_mb("VmHWM")
            srv.reset_peak()
            try:
                results = run_clients(srv.url("/v1/completions"), prompts, args.max_tokens,
                                      bias, args.timeout)
            except RuntimeError as e:
                raise RuntimeError(f"{config['name']}: {e}; server log: {srv.tail()}") from e
            serve_peak = srv.status_mb("VmHWM")
        finally:
            gpu = sampler.finish() if sampler else None
    return measure(results, ready, max(start_peak, serve_peak), serve_peak, gpu)


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


def fmt(v):
    return "-" if v is None else f"{v:.3f}" if isinstance(v, float) else str(v)


def summarise(records, configs, layers, kv_heads):
    """Per config: medians over rounds, ratio to stock paired by round, worst peaks."""
    stock = {r["round"]: r for r in records if r["config"] == "stock"}
    kvcache = [r["kvcache_mb"] for r in records if r.get("kvcache_mb")]
    rows = {}
    for c in configs:
        rs = [r for r in records if r["config"] == c["name"]]
        ratios = [r["agg_tok_s"] / stock[r["round"]]["agg_tok_s"] for r in rs
                  if r["round"] in stock]
        peak = [r["gpu_peak_mb"] for r in rs if r["gpu_peak_mb"] is not None]
        row = {"budget": c["budget"], "rounds": len(rs),
               "agg_tok_s": statistics.median(r["agg_tok_s"] for r in rs),
               "ratio_vs_stock": statistics.median(ratios) if ratios else None,
               "ttft_med_s": statistics.median(r["ttft_med_s"] for r in rs),
               "ttft_max_s": max(r["ttft_max_s"] for r in rs),
               "kv_mb": statistics.median(kvcache) if kvcache else None, "kv_bound_mb": None,
               "serve_peak_rss_mb": max(r["serve_peak_rss_mb"] for r in rs),
               "peak_rss_mb": max(r["peak_rss_mb"] for r in rs),
               "gpu_peak_mb": max(peak) if peak else None}
        if c["budget"]:
            row["kv_mb"] = max(r["kv_mb"] for r in rs)
            row["kv_bound_mb"] = kv_bound(rs[0]["h2o"], c["budget"], layers, kv_heads) / MB
        rows[c["name"]] = row
    return rows


def print_table(rows, context):
    print("| server | KV budget | aggregate tok/s | vs stock | TTFT median / max (s) | "
          "KV a request (MB) | peak RSS serving / process (MB) | GPU peak (MB) |")
    print("|---|---|---|---|---|---|---|---|")
    for name, r in rows.items():
        budget = "-" if not r["budget"] else f"{r['budget']}" + (
            "" if context > r["budget"] else " (not reached)")
        kv = "-" if r["kv_mb"] is None else f"{r['kv_mb']:.1f}" + (
            f" (bound {r['kv_bound_mb']:.1f})" if r["kv_bound_mb"] else "")
        ratio = "-" if r["ratio_vs_stock"] is None else f"{r['ratio_vs_stock']:.2f}x"
        gpu = "-" if r["gpu_peak_mb"] is None else f"{r['gpu_peak_mb']:.0f}"
        print(f"| {name} | {budget} | {r['agg_tok_s']:.2f} | {ratio} | {r['ttft_med_s']:.2f} / "
              f"{r['ttft_max_s']:.2f} | {kv} | {r['serve_peak_rss_mb']:.0f} / "
              f"{r['peak_rss_mb']:.0f} | {gpu} |")
    stock = rows.get("stock")
    for name, r in rows.items():
        if r["budget"] and stock and r["ratio_vs_stock"] is not None:
            print(f"target {name}: aggregate {r['ratio_vs_stock']:.2f}x stock "
                  f"(>= 0.95: {'yes' if r['ratio_vs_stock'] >= 0.95 else 'no'}); KV a request "
                  f"{r['kv_mb']:.1f} MB <= bound {r['kv_bound_mb']:.1f} MB: "
                  f"{'yes' if r['kv_mb'] <= r['kv_bound_mb'] else 'no'} (stock "
                  f"{fmt(stock['kv_mb'])} MB); serving peak RSS {r['serve_peak_rss_mb']:.0f} "
                  f"MB vs stock {stock['serve_peak_rss_mb']:.0f} MB")


def server_configs(args, model: Path):
    h2o_model = [] if args.model is None and args.random is None else ["--model", str(
        model if args.random else args.model)]
    common = shlex.split(args.server_args)
    configs = [{"name": "stock", "budget": 0, "argv": ["-m", "mlx_lm", "server", "--model",
                                                        str(model), *common]}]
    for b in args.budgets:
        configs.append({"name": f"h2o-{b}", "budget": b, "argv": [
            "-m", "mlx_h2o", "serve", *h2o_model, "--max-kv-size", str(b), *common,
            *shlex.split(args.h2o_args)]})
    return configs


def resolve(args, tmp: Path) -> Path:
    """The served model's folder (the random one built in a child process)."""
    from mlx_h2o.models import PACKAGED_MODELS, resolve_model

    if args.random:
        tokenizer = args.tokenizer or resolve_model("smollm2-135m")
        out = tmp / f"random-{args.random}"
        subprocess.run([sys.executable, __file__, "--save-random", str(out), "--random",
                        args.random, "--random-bits", str(args.random_bits), "--tokenizer",
                        str(tokenizer)], check=True)
        return out
    if args.model is None or args.model in PACKAGED_MODELS:
        return Path(resolve_model(args.model))
    if not Path(args.model, "config.json").exists():
        raise SystemExit(f"--model {args.model}: needs a local model folder or packaged name")
    return Path(args.model)


def _interrupt(*_):
    raise KeyboardInterrupt  # SIGTERM: unwind, so every server is stopped


def setup_arg_parser():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clients", type=int, default=4, help="concurrent requests")
    p.add_argument("--prompt-tokens", type=int, default=1024)
    p.add_argument("--max-tokens", type=int, default=64, help="tokens generated a request")
    p.add_argument("--budgets", type=int, nargs="*", default=[256, 1024],
                   help="--max-kv-size of each mlx-h2o server")
    p.add_argument("--rounds", type=int, default=2, help="rotations over the servers")
    p.add_argument("--model", default=None,
                   help="local mlx-lm model folder or packaged name (default: SmolLM2)")
    p.add_argument("--random", default=None, metavar="NAME",
                   help="serve random weights with NAME's shapes, e.g. qwen3-8b")
    p.add_argument("--random-bits", type=int, default=4, choices=(0, 4, 8),
                   help="quantize the random model (0: bfloat16)")
    p.add_argument("--tokenizer", default=None, metavar="DIR",
                   help="--random's tokenizer files (default: the packaged SmolLM2's)")
    p.add_argument("--server-args", default="", help="extra flags for every server")
    p.add_argument("--h2o-args", default="", help="extra flags for the mlx-h2o servers")
    p.add_argument("--timeout", type=float, default=600, help="seconds a request may take")
    p.add_argument("--start-timeout", type=float, default=300, help="seconds to /health")
    p.add_argument("--log-dir", default=None, help="keep the servers' logs here")
    p.add_argument("--save-random", default=None, help=argparse.SUPPRESS)
    return p


def main():
    args = setup_arg_parser().parse_args()
    if args.save_random:
        save_random_model(Path(args.save_random), args.random, args.random_bits,
                          Path(args.tokenizer))
        return
    if args.clients < 1 or args.rounds < 1 or args.prompt_tokens < 16 or args.max_tokens < 2:
        raise SystemExit("--clients, --rounds >= 1, --prompt-tokens >= 16, --max-tokens >= 2")
    if args.model and args.random:
        raise SystemExit("--model and --random exclude each other")
    signal.signal(signal.SIGTERM, _interrupt)
    tmp = Path(tempfile.mkdtemp(prefix="serve_bench_"))
    logs = Path(args.log_dir) if args.log_dir else tmp
    logs.mkdir(parents=True, exist_ok=True)
    try:
        run(args, tmp, logs)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def run(args, tmp: Path, logs: Path):
    import mlx.core as mx
    import mlx_lm

    model = resolve(args, tmp)
    tok, eos, layers, kv_heads = model_info(model)
    bias = {str(i): -1e4 for i in eos}  # every request generates --max-tokens
    configs = server_configs(args, model)
    context = args.prompt_tokens + args.max_tokens
    name = (f"random {args.random} ({args.random_bits or 16}-bit)" if args.random
            else args.model or "smollm2-135m (packaged)")
    print(f"config: model={name} clients={args.clients} prompt_tokens={args.prompt_tokens} "
          f"max_tokens={args.max_tokens} budgets={args.budgets} rounds={args.rounds} "
          f"server_args='{args.server_args}' h2o_args='{args.h2o_args}' banned_eos={eos} "
          f"mlx={mx.__version__} mlx_lm={mlx_lm.__version__} python={platform.python_version()} "
          f"machine={platform.machine()} cpus={os.cpu_count()} "
          f"load={'/'.join(f'{x:.1f}' for x in os.getloadavg())}", flush=True)
    for c in configs:
        print(f"server {c['name']}: python {' '.join(c['argv'])}")
    records = []
    for r in range(args.rounds):
        *prompts, warm = make_prompts(tok, [args.prompt_tokens] * args.clients + [64], seed=r)
        for c in configs[r % len(configs):] + configs[:r % len(configs)]:
            rec = trial(c, prompts, warm, bias, args, logs / f"round{r}_{c['name']}.log")
            rec = {"round": r, "config": c["name"], "budget": c["budget"],
                   "load1": round(os.getloadavg()[0], 1), **rec}
            records.append(rec)
            print(" ".join(f"{k}={fmt(v)}" for k, v in rec.items() if k != "h2o"), flush=True)
    rows = summarise(records, configs, layers, kv_heads)
    print_table(rows, context)
    trials = [{k: v for k, v in rec.items() if k != "h2o"} for rec in records]
    print(json.dumps({"config": {k: v for k, v in vars(args).items() if k != "save_random"},
                      "mlx": mx.__version__, "mlx_lm": mlx_lm.__version__, "summary": rows,
                      "trials": trials}))


if __name__ == "__main__":
    main()
