"""`mlx-h2o serve` with real HTTP clients against real servers on 127.0.0.1.

A tiny random llama saved as an mlx-lm model folder (SmolLM2's packaged
tokenizer and chat template) is served by `mlx-h2o serve` and by stock
`mlx_lm server`: within the budget, greedy answers must be the same; past
it, every request must finish with a cache of at most the budget. Every
request has a timeout; each server is stopped at the end of the module.
"""

import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

from tiny_models import tiny_llama

BUDGET = 64  # --max-kv-size
TINY = dict(hidden_size=64, num_hidden_layers=2, intermediate_size=128,
            num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
            vocab_size=49152, head_dim=16, rope_theta=10000.0, tie_word_embeddings=True)
# Per slot and layer: K and V in float32, then position, score and count.
BUDGET_BYTES = BUDGET * TINY["num_hidden_layers"] * TINY["num_key_value_heads"] * (
    2 * TINY["head_dim"] * 4 + 12)
# K and V of one token in every layer, float32.
TOKEN_BYTES = TINY["num_hidden_layers"] * TINY["num_key_value_heads"] * 2 * TINY["head_dim"] * 4
SERVER_FLAGS = ["--prefill-step-size", "32", "--decode-concurrency", "4",
                "--prompt-concurrency", "2", "--max-tokens", "12"]
OPENBLAS = "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0"
WORDS = ("the cat sat on a mat while seven dogs ran over green hills near old "
         "river towns and every child sang songs about bright stars").split()


def words(n, seed):
    rng = np.random.default_rng(seed)
    return " ".join(rng.choice(WORDS, n))


def save_tiny_model(path: Path) -> Path:
    """A random tiny llama as an mlx-lm model folder, with SmolLM2's tokenizer."""
    from mlx_h2o.models import resolve_model

    source = Path(resolve_model("smollm2-135m"))
    path.mkdir(parents=True, exist_ok=True)
    model = tiny_llama(**TINY)
    mx.save_safetensors(str(path / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (path / "config.json").write_text(json.dumps({"model_type": "llama", **TINY}))
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(source / name, path / name)
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A server subprocess on 127.0.0.1 and a JSON client for it."""

    def __init__(self, argv, log: Path):
        self.port, self.log_path = free_port(), log
        env = dict(os.environ)
        if Path(OPENBLAS).exists():
            env["LD_PRELOAD"] = OPENBLAS
        self._log = open(log, "w")
        self.proc = subprocess.Popen(
            [sys.executable, *argv, "--host", "127.0.0.1", "--port", str(self.port)],
            stdout=self._log, stderr=subprocess.STDOUT, env=env)

    def url(self, path):
        return f"http://127.0.0.1:{self.port}{path}"

    def wait_ready(self, timeout=60):
        end = time.time() + timeout
        while time.time() < end:
            if self.proc.poll() is not None:
                pytest.fail(f"server exited: {self.log_path.read_text()[-2000:]}")
            try:
                with urllib.request.urlopen(self.url("/health"), timeout=2) as r:
                    if r.status == 200:
                        return self
            except OSError:
                time.sleep(0.2)
        pytest.fail(f"server not ready in {timeout} s: {self.log_path.read_text()[-2000:]}")

    def _request(self, path, body):
        return urllib.request.Request(self.url(path), data=json.dumps(body).encode(),
                                      headers={"Content-Type": "application/json"})

    def post(self, path, body, timeout=60):
        with urllib.request.urlopen(self._request(path, body), timeout=timeout) as r:
            return json.loads(r.read())

    def stream(self, path, body, timeout=60):
        """(text, finish_reason, usage) of a streamed response."""
        body = dict(body, stream=True, stream_options={"include_usage": True})
        text, finish, usage = [], None, None
        with urllib.request.urlopen(self._request(path, body), timeout=timeout) as r:
            for raw in r:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                usage = chunk.get("usage") or usage
                for choice in chunk["choices"]:
                    text.append(choice.get("text") or choice.get("delta", {}).get("content") or "")
                    finish = choice.get("finish_reason") or finish
        return "".join(text), finish, usage

    def ask(self, kind, prompt, stream=False, **extra):
        """(text, finish_reason, usage): a chat (``prompt``: messages) or text completion."""
        path, body = (("/v1/chat/completions", {"messages": prompt}) if kind == "chat"
                      else ("/v1/completions", {"prompt": prompt}))
        body.update(temperature=0.0, **extra)
        if stream:
            return self.stream(path, body)
        r = self.post(path, body)
        choice = r["choices"][0]
        text = choice["message"]["content"] if kind == "chat" else choice["text"]
        return text or "", choice["finish_reason"], r["usage"]

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self._log.close()


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("serve")
    model = str(save_tiny_model(tmp / "tiny"))
    h2o = Server(["-m", "mlx_h2o", "serve", "--model", model, "--max-kv-size", str(BUDGET),
                  *SERVER_FLAGS], tmp / "h2o.log")
    stock = Server(["-m", "mlx_lm", "server", "--model", model, *SERVER_FLAGS],
                   tmp / "stock.log")
    try:
        yield h2o.wait_ready(), stock.wait_ready()
    finally:
        h2o.stop()
        stock.stop()


def chat(text):
    return [{"role": "user", "content": text}]


def check_bounded(usage):
    h2o = usage["h2o"]
    assert h2o["tokens_kept"] <= BUDGET and h2o["kv_bytes"] <= BUDGET_BYTES
    assert h2o["tokens_seen"] == h2o["tokens_kept"] + h2o["tokens_evicted"]
    assert (h2o["layers"], h2o["max_kv_size"], h2o["layer_max_size"]) == (2, BUDGET,
                                                                          [BUDGET] * 2)
    # mlx-lm's KVCache for the same tokens: exactly, and in 256-token steps
    seen = h2o["tokens_seen"]
    assert h2o["kvcache_bytes"] == seen * TOKEN_BYTES
    assert h2o["kvcache_allocated_bytes"] == -(-seen // 256) * 256 * TOKEN_BYTES
    assert usage["prompt_tokens"] <= h2o["tokens_seen"]
    assert h2o["tokens_seen"] <= usage["prompt_tokens"] + usage["completion_tokens"]


# --- within the budget: stock mlx_lm.server's answers --------------------------------------
@pytest.mark.parametrize("kind", ["chat", "text"])
@pytest.mark.parametrize("stream", [False, True])
def test_greedy_answers_equal_stock_within_budget(servers, kind, stream):
    h2o, stock = servers
    prompt = chat(words(6, seed=1)) if kind == "chat" else words(20, seed=2)
    got = h2o.ask(kind, prompt, stream, max_tokens=10)
    want = stock.ask(kind, prompt, stream, max_tokens=10)
    assert got[:2] == want[:2] and got[2]["h2o"]["tokens_evicted"] == 0
    assert got[2]["h2o"]["batched"] and got[2]["prompt_tokens"] == want[2]["prompt_tokens"]
    check_bounded(got[2])


def test_multi_turn_reuses_the_prompt_cache(servers):
    h2o, stock = servers
    turns = [chat(words(4, seed=3))]
    answers = []
    for turn in range(2):
        got = h2o.ask("chat", turns[-1], max_tokens=5)
        want = stock.ask("chat", turns[-1], max_tokens=5)
        assert got[:2] == want[:2]
        answers.append(got)
        turns.append(turns[-1] + [{"role": "assistant", "content": got[0]},
                                  {"role": "user", "content": words(3, seed=4 + turn)}])
    assert answers[1][2]["prompt_tokens_details"]["cached_tokens"] > 0
    # Past the budget the next turn starts from the compressed cache.
    long_turn = turns[-1] + [{"role": "user", "content": words(60, seed=9)}]
    first = h2o.ask("chat", long_turn, max_tokens=4)
    follow = long_turn + [{"role": "assistant", "content": first[0]},
                          {"role": "user", "content": "and then"}]
    second = h2o.ask("chat", follow, max_tokens=4)
    assert second[2]["prompt_tokens_details"]["cached_tokens"] > 0
    for _, finish, usage in (first, second):
        assert finish in ("length", "stop") and usage["h2o"]["tokens_evicted"] > 0
        check_bounded(usage)


# --- past the budget: concurrent clients, a disconnect, the one-at-a-time path ------------------
def test_concurrent_clients_join_and_leave(servers):
    h2o, _ = servers
    lengths = [5, 150, 30, 90, 12, 200, 40]
    results, errors = {}, []

    def client(i, n):
        try:
            time.sleep(0.05 * i)  # join while the others prefill and decode
            kind = "chat" if i % 2 else "text"
            prompt = chat(words(n, seed=20 + i)) if kind == "chat" else words(n, seed=20 + i)
            results[i] = h2o.ask(kind, prompt, stream=i % 3 == 0, max_tokens=60 - 8 * i)
        except Exception as e:  # noqa: BLE001 (reported below)
            errors.append(f"client {i}: {e!r}")

    threads = [threading.Thread(target=client, args=(i, n)) for i, n in enumerate(lengths)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=90)
    assert not errors and len(results) == len(lengths)
    for i, (text, finish, usage) in results.items():
        assert finish in ("length", "stop") and 1 <= usage["h2o"]["batch_rows"] <= 4
        check_bounded(usage)
        if usage["prompt_tokens"] > BUDGET:
            assert usage["h2o"]["tokens_evicted"] > 0
    # Continuous batching: requests decoded side by side (--decode-concurrency 4).
    assert max(usage["h2o"]["batch_rows"] for _, _, usage in results.values()) >= 3


# --- start-up: one-line errors, reversible hooks -------------------------------------------
@pytest.mark.parametrize("argv, says", [
    (["--kv-bits", "4"], "--kv-bits"),
    (["--h2o-kv-bits", "8"], "--h2o-kv-bits"),
    (["--h2o-evict-batch", "4"], "--h2o-evict-batch"),
    (["--max-kv-size", "0"], "--max-kv-size must be >= 1"),
    (["--h2o-max-size", "0"], "--max-kv-size must be >= 1"),  # its old spelling
    (["--max-kv-size", "8", "--h2o-sink-size", "8"], "--h2o-sink-size"),
    (["--no-h2o", "--h2o-max-size", "64"], "--no-h2o"),
    (["--no-h2o", "--max-kv-size", "64"], "mlx_lm.server has no bounded cache"),
    (["--model", "/no/such/folder"], "--model /no/such/folder"),
    (["--max-body-bytes", "0"], "--max-body-bytes must be an integer >= 1"),
    (["--max-prompt-tokens", "-5"], "--max-prompt-tokens must be an integer >= 1"),
    (["--header-timeout", "0"], "--header-timeout must be a number of seconds > 0"),
    (["--body-timeout", "nan"], "--body-timeout must be a number of seconds > 0"),
    (["--max-tokens", "9000"], "--max-tokens 9000: the default max_tokens must be from 1 to "
     "--max-tokens-limit (8192)"),
    (["--max-tokens-limit", "100"], "--max-tokens 512"),
])
def test_bad_configurations_end_with_one_line(capsys, argv, says):
    from mlx_h2o.cli import serve

    with pytest.raises(SystemExit) as exit_:
        serve.main(argv)
    err = capsys.readouterr().err.strip()
    assert exit_.value.code == 2 and "\n" not in err
    assert err.startswith("mlx-h2o serve: error: ") and says in err


def test_serve_takes_every_mlx_lm_server_flag():
    from mlx_h2o.cli import serve

    ours = {s for a in serve.setup_arg_parser()._actions for s in a.option_strings}
    theirs = {s for a in serve.mlx_lm_server_parser()._actions for s in a.option_strings}
    assert {"--decode-concurrency", "--prompt-cache-bytes", "--kv-bits"} <= theirs <= ours
    assert {"--max-kv-size", "--h2o-max-size", "--h2o-score", "--no-h2o"} <= ours


def test_h2o_server_hooks_every_cache_path_and_restores_them():
    import mlx_lm.server as server
    from mlx_lm.models import cache as mlx_cache

    generate = sys.modules["mlx_lm.generate"]  # (mlx_lm.generate is also a function)

    from mlx_h2o import H2OConfig, H2OKVCache, is_enabled
    from mlx_h2o.integration.serve import h2o_server

    before = {m: (m.make_prompt_cache, getattr(m, "BatchGenerator", None))
              for m in (server, generate, mlx_cache)}
    model = tiny_llama()
    with h2o_server(H2OConfig(max_size=32)):
        assert is_enabled() and hasattr(H2OKVCache, "merge")
        for module in before:
            caches = module.make_prompt_cache(model)
            assert all(type(c) is H2OKVCache for c in caches)
        assert issubclass(server.BatchGenerator, generate.BatchGenerator)
        assert server.BatchGenerator is not generate.BatchGenerator
    after = {m: (m.make_prompt_cache, getattr(m, "BatchGenerator", None)) for m in before}
    assert after == before and not is_enabled()


def test_client_disconnecting_mid_stream(servers):
    h2o, _ = servers
    body = json.dumps({"prompt": words(100, seed=30), "max_tokens": 400,
                       "stream": True}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
            f"application/json\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", h2o.port), timeout=30) as sock:
        sock.sendall(head + body)
        reader = sock.makefile("rb")
        data = []
        while len(data) < 3:  # a few streamed tokens, then hang up
            line = reader.readline()
            assert line, "the server closed the stream first"
            data += [line] if line.startswith(b"data:") else []
        reader.close()
    text, finish, usage = h2o.ask("text", words(40, seed=31), max_tokens=6)
    assert finish in ("length", "stop")
    check_bounded(usage)
    with urllib.request.urlopen(h2o.url("/health"), timeout=10) as r:
        assert json.loads(r.read())["status"] == "ok"
    # The handler's BrokenPipeError is logged (as by mlx_lm.server); generation goes on.
    assert "generation thread died" not in h2o.log_path.read_text()


def test_seeded_request_is_served_alone_with_h2o(servers):
    h2o, _ = servers
    text, finish, usage = h2o.ask("text", words(80, seed=40), max_tokens=5, seed=7)
    assert finish in ("length", "stop") and not usage["h2o"]["batched"]
    assert usage["h2o"]["tokens_evicted"] > 0
    check_bounded(usage)


# --- the real model -------------------------------------------------------------------------
@pytest.mark.real_model
def test_smollm2_served_by_default(tmp_path):
    """`mlx-h2o serve --max-kv-size 64` with every other default, on the packaged
    model (which ships a layer profile): a chat whose prompt and answer are
    fewer than 64 tokens gets stock mlx_lm.server's greedy answer, streamed or
    not; a longer one is held to 64 tokens a layer."""
    from mlx_h2o.models import resolve_model

    flags = ["--max-tokens", "8", "--prefill-step-size", "128"]
    h2o = Server(["-m", "mlx_h2o", "serve", "--max-kv-size", "64", *flags],
                 tmp_path / "h2o.log")
    stock = Server(["-m", "mlx_lm", "server", "--model", resolve_model("smollm2-135m"),
                    *flags], tmp_path / "stock.log")
    try:
        h2o.wait_ready(), stock.wait_ready()
        for question, stream in (("Tell me a joke.", True), ("Hello!", False)):
            prompt_tokens = stock.ask("chat", chat(question), max_tokens=1)[2]["prompt_tokens"]
            n = 64 - 1 - prompt_tokens  # prompt and answer: 63 tokens
            got = h2o.ask("chat", chat(question), stream, max_tokens=n)
            want = stock.ask("chat", chat(question), stream, max_tokens=n)
            assert got[:2] == want[:2] and got[2]["h2o"]["tokens_evicted"] == 0
            assert got[2]["h2o"]["layer_max_size"] == [64, 64]
        prose = (Path(__file__).parent / "data" / "python_docs_prose.txt").read_text()
        long = h2o.ask("chat", chat(prose[:1500] + "\nSummarise this."), max_tokens=6)
        assert long[1] in ("length", "stop") and long[2]["h2o"]["tokens_evicted"] > 0
        assert long[2]["h2o"]["tokens_kept"] == 64
    finally:
        h2o.stop()
        stock.stop()
