"""benchmarks/serve_bench.py: its pure parts, its servers against a stand-in, a tiny run.

Pure parts on made-up records: ratios paired by round and their median (a cold
round cannot carry it), the summary and table of a run where a server died, the
capacity search against a function that answers up to a limit. A stand-in
server (a few lines of http.server, no model) answers up to ``limit``
concurrent requests and past it dies, turns /health unavailable (as
mlx_lm.server does when its generation thread dies) or hangs: the benchmark
records the load it failed at and why, restarts it for the next capacity load,
and serves the other configs; every load, the warm-up too, has the trial's
shapes. Then the tiny random llama of test_serve.py served by stock `mlx_lm
server` and `mlx-h2o serve` end to end: every request generates its tokens, no
prompt cache reuse, H2O caches within the bound the script reports, the GPU
peak of a fake nvidia-smi, the table under its command in --out. Interrupted,
it leaves no server running. The random-weight model it builds for GPUs
decodes only ids its tokenizer knows.
"""

import importlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from test_serve import OPENBLAS, save_tiny_model

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
SCRIPT = BENCH / "serve_bench.py"
CLIENTS, MAX_TOKENS, BUDGET = 2, 6, 32


def load(name):
    """A module of benchmarks/ (they import each other by name, from that folder)."""
    sys.path.insert(0, str(BENCH))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(BENCH))


# --- pure parts -----------------------------------------------------------------------------
def record(config, rnd, agg, ttft=1.0, decode=10.0, gpu=None):
    return {"config": config, "round": rnd, "agg_tok_s": agg, "ttft_med_s": ttft,
            "ttft_max_s": ttft, "decode_tok_s": decode, "serve_peak_rss_mb": 100.0,
            "peak_rss_mb": 120.0, "gpu_peak_mb": gpu}


CONFIGS = [{"name": "stock", "budget": 0}, {"name": "h2o-256", "budget": 256}]


def test_paired_median_is_not_carried_by_a_cold_round():
    """Stock's round 0 paid the kernels' compilation (a tenth of its speed): the
    mean of paired ratios would call H2O 1.6x stock; their median says 0.6x."""
    report = load("serve_report")
    records = [record("stock", 0, 10.0, ttft=40.0), record("stock", 1, 100.0, ttft=2.0),
               record("stock", 2, 110.0, ttft=2.5), record("h2o-256", 0, 36.0, ttft=8.0),
               record("h2o-256", 1, 60.0, ttft=2.4), record("h2o-256", 2, 55.0, ttft=3.5)]
    ratios = report.paired_ratios(records, "h2o-256", "agg_tok_s")
    assert ratios == pytest.approx([3.6, 0.6, 0.5])
    rows = report.summarise(records, [], CONFIGS, layers=2, kv_heads=1)
    assert rows["h2o-256"]["agg_vs_stock"] == pytest.approx(0.6)
    assert rows["h2o-256"]["ttft_vs_stock"] == pytest.approx(1.2)
    assert rows["h2o-256"]["pairs"] == 3 and rows["stock"]["agg_vs_stock"] == 1.0


def test_ratios_pair_only_rounds_both_answered():
    report = load("serve_report")
    records = [record("stock", 0, 100.0), record("h2o-256", 0, 50.0),
               record("h2o-256", 1, 80.0), record("h2o-256", 2, 90.0)]
    assert report.paired_ratios(records, "h2o-256", "agg_tok_s") == [0.5]


def test_summary_and_table_show_a_dead_server():
    report = load("serve_report")
    records = [record("h2o-256", r, 11.0, gpu=50_000.0) for r in range(3)]
    died = {"config": "stock", "budget": 0, "clients": 8, "prompt_tokens": 16384,
            "at": "warm-up", "kind": "died", "error": "RuntimeError: out of memory"}
    rows = report.summarise(records, [died], CONFIGS, layers=2, kv_heads=1)
    assert rows["stock"]["rounds"] == 0 and rows["stock"]["agg_tok_s"] is None
    assert rows["stock"]["failure"] == ("stock: died at 8 clients x 16,384 tokens (warm-up): "
                                        "RuntimeError: out of memory")
    assert rows["h2o-256"]["agg_vs_stock"] is None and rows["h2o-256"]["failure"] is None
    lines = report.rounds_table(rows, context=16448)
    assert lines[2].startswith("| stock | - | 0 (failed: below) | - | - | - / - |")
    assert lines[3].startswith("| h2o-256 | 256 | 3 | 11.00 | - |") and "| 50000 |" in lines[3]
    assert rows["stock"]["failure"] in lines
    assert any(line.startswith("h2o-256 vs stock (medians of 0 paired rounds)") for line in lines)


@pytest.mark.parametrize("limit, max_clients, bisect, answered, failed, tried", [
    (5, 64, False, 4, 8, [1, 2, 4, 8]),
    (5, 64, True, 5, 6, [1, 2, 4, 8, 6, 5]),
    (7, 64, True, 7, 8, [1, 2, 4, 8, 6, 7]),
    (100, 48, True, 48, None, [1, 2, 4, 8, 16, 32, 48]),
    (0, 8, True, 0, 1, [1]),
    (1, 1, True, 1, None, [1]),
])
def test_capacity_search_doubles_then_bisects(limit, max_clients, bisect, answered, failed,
                                              tried):
    report = load("serve_report")
    asked = []

    def answers(n):  # a server that answers up to ``limit`` clients
        asked.append(n)
        return n <= limit

    found = report.search_capacity(answers, max_clients, bisect)
    assert found == (answered, failed, [(n, n <= limit) for n in tried]) and asked == tried


def test_capacity_search_from_a_first_load():
    report = load("serve_report")
    assert report.search_capacity(lambda n: n <= 20, 32, True, min_clients=16) == (
        20, 21, [(16, True), (32, False), (24, False), (20, True), (22, False), (21, False)])
    assert report.search_capacity(lambda n: n <= 5, 32, True, min_clients=8)[:2] == (5, 6)
    with pytest.raises(ValueError, match="1 <= min_clients <= max_clients"):
        report.search_capacity(lambda n: True, 0)


def test_capacity_table_compares_with_stock():
    report = load("serve_report")
    stock = {"budget": 0, "clients": 4, "failed_at": 5, "loads": [
        {"clients": n, "ok": True} for n in (1, 2, 4)] + [
        {"clients": 8, "ok": False, "kind": "died", "error": "out | of memory"},
        {"clients": 5, "ok": False, "kind": "timed out", "error": "over 600 s"}]}
    h2o = {"budget": 1024, "clients": 32, "failed_at": None,
           "loads": [{"clients": n, "ok": True} for n in (1, 2, 4, 8, 16, 32)]}
    lines = report.capacity_table({"stock": stock, "h2o-1024": h2o}, 16384, 64)
    assert "16,384-token prompts, 64 tokens" in lines[0]
    assert lines[2] == ("| stock | - | 4 (5 failed) | 1 ok, 2 ok, 4 ok, 8 died, 5 timed out | "
                        "5 clients: timed out: over 600 s |")
    assert lines[3].startswith("| h2o-1024 | 1024 | >= 32 (none failed) |")
    assert lines[-1] == ("h2o-1024 answers 8.0x stock's clients (32 vs 4); "
                         "h2o-1024 failed no load: it may answer more")


def test_log_error_is_the_last_line_that_names_one():
    text = ("INFO starting\nmlx_lm.server generation thread died: [cuda] out of memory\n"
            "Traceback (most recent call last):\n  File \"x.py\", line 1\n"
            "RuntimeError: [cuda] out of memory\n\n")
    assert load("serve_load").log_error(text) == "RuntimeError: [cuda] out of memory"
    assert load("serve_load").log_error("just\nlines\n") == "lines"


# --- a stand-in server ---------------------------------------------------------------------
STAND_IN = r'''
import json, os, sys, threading, time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

mode, limit = sys.argv[1], int(sys.argv[2])
if mode == "no-start":
    sys.exit("ValueError: --max-kv-size must be >= 1")
lock, state = threading.Lock(), {"busy": 0, "dead": False}


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def do_GET(self):
        self.send_response(503 if state["dead"] else 200)
        self.end_headers()

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        with lock:  # one whole line at a time: the load's requests arrive together
            print(f"request {body['max_tokens']}", flush=True)
            state["busy"] += 1
        time.sleep(0.5)  # the load's other requests arrive
        if state["busy"] > limit:
            print("RuntimeError: [cuda] out of memory", flush=True)
            if mode == "exit":
                os._exit(1)
            state["dead"] = mode == "health"
            time.sleep(3600)
        self.send_response(200)
        self.end_headers()
        for _ in range(body["max_tokens"]):
            self.wfile.write(b'data: {"choices": [{"text": "a"}]}\n\n')
        usage = {"prompt_tokens": 16, "completion_tokens": body["max_tokens"]}
        self.wfile.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
        self.wfile.write(b"data: [DONE]\n\n")
        with lock:
            state["busy"] -= 1


port = int(sys.argv[sys.argv.index("--port") + 1])
ThreadingHTTPServer(("127.0.0.1", port), Handler).serve_forever()
'''


def stand_in(name, mode, limit):
    return {"name": name, "budget": 0 if name == "stock" else 64,
            "argv": ["-c", STAND_IN, mode, str(limit)]}


def bench_args(**kw):
    """The script's own defaults, small loads."""
    args = load("serve_bench").setup_arg_parser().parse_args([])
    return SimpleNamespace(**{**vars(args), "clients": 2, "prompt_tokens": 16, "max_tokens": 4,
                              "timeout": 30.0, "start_timeout": 30.0, "max_clients": 8,
                              "bisect": True, **kw})


@pytest.fixture
def bench(monkeypatch):
    module = load("serve_bench")
    monkeypatch.setattr(module, "make_prompts",
                        lambda tok, lengths, seed: [f"{seed}:{i}" for i in range(len(lengths))])
    return module


def server_pids(lines):
    return [int(line.split("pid=")[1].split()[0]) for line in lines
            if line.startswith("server config=")]


def gone(pid, wait: float = 20.0):
    """Whether process ``pid`` has ended within ``wait`` seconds (a server
    stopped by SIGTERM takes a moment to exit on a loaded machine)."""
    deadline = time.monotonic() + wait
    while True:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        if Path(f"/proc/{pid}/status").read_text().count("zombie") > 0:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)


@pytest.mark.parametrize("mode, why", [("exit", "exited (1): RuntimeError: [cuda] out of memory"),
                                       ("health", "/health unavailable: RuntimeError")])
def test_capacity_restarts_a_server_that_died(bench, tmp_path, capsys, mode, why):
    found = bench.capacity_of(stand_in("stock", mode, 3), bench_args(), None, {}, tmp_path)
    assert found["clients"] == 3 and found["failed_at"] == 4
    assert [(x["clients"], x["ok"]) for x in found["loads"]] == [
        (1, True), (2, True), (4, False), (3, True)]
    dead = found["loads"][2]
    assert dead["kind"] == "died" and dead["error"].startswith(why)
    pids = server_pids(capsys.readouterr().out.splitlines())
    assert len(pids) == 2 and all(gone(pid) for pid in pids)  # restarted after the death


def test_a_load_past_its_timeout_fails_fast(bench, tmp_path):
    found = bench.capacity_of(stand_in("stock", "hang", 1), bench_args(timeout=1.0), None, {},
                              tmp_path)
    assert found["clients"] == 1 and found["loads"][-1]["kind"] == "timed out"


def test_rounds_are_warmed_on_their_shapes_and_go_on_after_a_death(bench, tmp_path, capsys):
    configs = [stand_in("stock", "health", 1), stand_in("h2o-64", "exit", 8),
               stand_in("h2o-8", "no-start", 8)]
    records, failures = bench.run_rounds(bench_args(), configs, None, {}, tmp_path)
    assert [(r["config"], r["round"]) for r in records] == [("h2o-64", r) for r in range(3)]
    assert all(r["completion_tokens"] == 2 * 4 for r in records)
    # the warm-up load had the rounds' shapes: 2 clients, 4 tokens each
    assert (tmp_path / "h2o-64.log").read_text().split("\n").count("request 4") == 2 * 4
    died, no_start = failures
    assert (died["config"], died["at"], died["kind"], died["clients"]) == (
        "stock", "warm-up", "died", 2)
    assert no_start["at"] == "start" and "must be >= 1" in no_start["error"]
    rows = load("serve_report").summarise(records, failures, configs, layers=1, kv_heads=1)
    assert rows["stock"]["failure"].startswith("stock: died at 2 clients x 16 tokens (warm-up):")
    assert rows["h2o-8"]["failure"].startswith("h2o-8: did not start: exited (1)")
    assert rows["h2o-64"]["rounds"] == 3 and rows["h2o-64"]["agg_vs_stock"] is None
    assert all(gone(pid) for pid in server_pids(capsys.readouterr().out.splitlines()))


def test_interleave_restarts_each_server_every_round_in_turn(bench, tmp_path, capsys):
    configs = [stand_in("stock", "exit", 8), stand_in("h2o-64", "exit", 8)]
    records, failures = bench.run_rounds(bench_args(interleave=True), configs, None, {},
                                         tmp_path)
    assert not failures
    assert [(r["config"], r["round"]) for r in records] == [
        ("stock", 0), ("h2o-64", 0), ("h2o-64", 1), ("stock", 1), ("stock", 2), ("h2o-64", 2)]
    assert len(server_pids(capsys.readouterr().out.splitlines())) == 6


def test_fewer_than_three_rounds_are_refused():
    out = subprocess.run([sys.executable, str(SCRIPT), "--rounds", "2"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode != 0 and "--rounds 2: use 3 or more" in out.stderr


# --- real servers, a tiny model ------------------------------------------------------------
def run_script(*argv, path=None):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if path is not None:
        env["PATH"] = f"{path}{os.pathsep}{env['PATH']}"
    if Path(OPENBLAS).exists():
        env["LD_PRELOAD"] = OPENBLAS
    # Ctrl-C as from a terminal: a suite started in the background (`make
    # test &`) ignores SIGINT, and its children would inherit that.
    return subprocess.Popen([sys.executable, str(SCRIPT), *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env,
                            preexec_fn=_sigint_default)


def _sigint_default():
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("bench") / "tiny")


def fake_nvidia_smi(folder: Path) -> Path:
    """An nvidia-smi whose memory.used (MiB) grows with time (milliseconds
    since the epoch): called from two threads at once, it never goes back."""
    script = folder / "nvidia-smi"
    script.write_text("#!/bin/sh\necho $(( $(date +%s%N) / 1000000 ))\n")
    script.chmod(0o755)
    return folder


def test_tiny_run_end_to_end(tiny, tmp_path):
    out_file = tmp_path / "table.md"
    proc = run_script("--model", str(tiny), "--clients", str(CLIENTS), "--prompt-tokens", "80",
                      "--max-tokens", str(MAX_TOKENS), "--budgets", str(BUDGET),
                      "--server-args", "--prefill-step-size 32", "--out", str(out_file),
                      "--h2o-args", "--h2o-layer-budget uniform", path=fake_nvidia_smi(tmp_path))
    out, _ = proc.communicate(timeout=180)
    lines = out.splitlines()
    assert proc.returncode == 0, out[-3000:]
    assert lines[0].startswith("config: ") and "| h2o-32 | 32 | 3 |" in out
    assert sum(line.startswith("round=warm-up ") for line in lines) == 2
    result = json.loads(lines[-1])
    trials = result["trials"]
    assert [(t["config"], t["round"]) for t in trials] == [
        (c, r) for c in ("stock", "h2o-32") for r in range(3)]
    for t in trials:  # end-of-sequence banned: every request runs to its length
        assert t["completion_tokens"] == CLIENTS * MAX_TOKENS and t["cached_tokens"] == 0
        assert t["prompt_tokens"] >= 78 and 0 < t["ttft_med_s"] <= t["ttft_max_s"]
        assert t["serve_peak_rss_mb"] <= t["peak_rss_mb"] and t["gpu_peak_mb"] > 0
    summary, h2o = result["summary"], trials[-1]
    assert h2o["tokens_kept"] == BUDGET and h2o["tokens_seen"] > BUDGET
    assert summary["h2o-32"]["kv_mb"] <= summary["h2o-32"]["kv_bound_mb"]
    assert summary["stock"]["kv_mb"] == h2o["kvcache_mb"] > h2o["kv_mb"]
    assert summary["stock"]["agg_vs_stock"] == 1.0 and summary["h2o-32"]["pairs"] == 3
    written = out_file.read_text()
    assert written.startswith("```sh\n") and f"--out {out_file}" in written.splitlines()[1]
    assert "| h2o-32 | 32 | 3 |" in written and json.loads(written.splitlines()[-2]) == result
    pids = server_pids(lines)
    assert len(pids) == 2 and all(gone(pid) for pid in pids)


def test_interrupted_run_stops_its_server(tiny):
    proc = run_script("--model", str(tiny), "--rounds", "3", "--budgets", str(BUDGET))
    lines = []
    for line in proc.stdout:  # SIGINT (Ctrl-C) once the first server is starting
        lines.append(line)
        if line.startswith("server config="):
            proc.send_signal(signal.SIGINT)
            break
    proc.communicate(timeout=60)
    pids = server_pids(lines)
    assert proc.returncode != 0 and len(pids) == 1 and gone(pids[0])


def test_prompts_have_their_length_and_distinct_first_tokens():
    from tokenizers import Tokenizer

    from mlx_h2o.models import resolve_model

    tok = Tokenizer.from_file(str(Path(resolve_model("smollm2-135m")) / "tokenizer.json"))
    prompts = load("serve_model").make_prompts(tok, [300] * 6 + [64], seed=0)
    ids = [tok.encode(p, add_special_tokens=False).ids for p in prompts]
    assert len({i[0] for i in ids}) == len(prompts)
    assert all(abs(len(i) - n) <= 2 for i, n in zip(ids, [300] * 6 + [64]))


def test_random_model_decodes_only_tokenizer_ids(tmp_path, monkeypatch):
    """Output rows past the tokenizer's vocabulary are zero (4-bit too): greedy
    decoding stays within it, so the server's detokenizer can read every id."""
    import mlx.core as mx
    import mlx_lm
    from mlx_lm.generate import generate_step

    from mlx_h2o.eval import bench as eval_bench
    from mlx_h2o.models import resolve_model

    monkeypatch.setitem(eval_bench.RANDOM_CONFIGS, "tiny-qwen3", dict(
        model_type="qwen3", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=50048,
        rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=4096,
        tie_word_embeddings=False))
    out = load("serve_model").save_random_model(tmp_path / "m", "tiny-qwen3", 4,
                                                Path(resolve_model("smollm2-135m")))
    model, tokenizer = mlx_lm.load(str(out))
    assert json.loads((out / "config.json").read_text())["quantization"]["bits"] == 4
    logits = model(mx.array([tokenizer.encode("The cat sat on the mat")]))[0]
    assert (logits[:, 49152:] == 0).all() and (logits[:, :49152].max(-1) > 0).all()
    steps = generate_step(mx.array(tokenizer.encode("Hi")), model, max_tokens=20)
    tokens = [int(token) for token, _ in steps]
    assert len(tokens) == 20 and max(tokens) < 49152 and tokenizer.decode(tokens)
