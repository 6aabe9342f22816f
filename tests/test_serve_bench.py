"""benchmarks/serve_bench.py: a tiny run end to end, its servers stopped, its prompts.

The tiny random llama of test_serve.py (SmolLM2's tokenizer) is served by
stock `mlx_lm server` and `mlx-h2o serve`; the benchmark's final JSON line
must show every request generating its tokens, no prompt cache reuse, H2O
caches within the bound the script reports, and the GPU peak of a fake
nvidia-smi. Interrupted, it leaves no server running. The random-weight
model it builds for GPUs decodes only ids its tokenizer knows.
"""

import importlib.util
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from test_serve import OPENBLAS, save_tiny_model

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "serve_bench.py"
CLIENTS, MAX_TOKENS, BUDGET = 2, 6, 32


def load_script():
    spec = importlib.util.spec_from_file_location("serve_bench", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def bench(*argv, path=None):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if path is not None:
        env["PATH"] = f"{path}{os.pathsep}{env['PATH']}"
    if Path(OPENBLAS).exists():
        env["LD_PRELOAD"] = OPENBLAS
    return subprocess.Popen([sys.executable, str(SCRIPT), *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env)


def server_pids(lines):
    return [int(line.split("pid=")[1].split()[0]) for line in lines
            if line.startswith("server config=")]


def gone(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return Path(f"/proc/{pid}/status").read_text().count("zombie") > 0


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("bench") / "tiny")


def fake_nvidia_smi(folder: Path) -> Path:
    """An nvidia-smi whose memory.used (MiB) grows by 10 a call."""
    script = folder / "nvidia-smi"
    script.write_text(f"#!/bin/sh\nn=$(cat {folder}/n 2>/dev/null || echo 0)\n"
                      f"echo $((n + 10)) > {folder}/n\necho $((n + 10))\n")
    script.chmod(0o755)
    return folder


def test_tiny_run_end_to_end(tiny, tmp_path):
    proc = bench("--model", str(tiny), "--clients", str(CLIENTS), "--prompt-tokens", "80",
                 "--max-tokens", str(MAX_TOKENS), "--budgets", str(BUDGET), "--rounds", "1",
                 "--server-args", "--prefill-step-size 32",
                 "--h2o-args", "--h2o-layer-budget uniform", path=fake_nvidia_smi(tmp_path))
    out, _ = proc.communicate(timeout=120)
    lines = out.splitlines()
    assert proc.returncode == 0, out[-3000:]
    assert lines[0].startswith("config: ") and "| h2o-32 | 32 |" in out
    result = json.loads(lines[-1])
    trials = {t["config"]: t for t in result["trials"]}
    assert set(trials) == {"stock", "h2o-32"}
    for t in trials.values():  # end-of-sequence banned: every request runs to its length
        assert t["completion_tokens"] == CLIENTS * MAX_TOKENS and t["cached_tokens"] == 0
        assert t["prompt_tokens"] >= 78 and 0 < t["ttft_med_s"] <= t["ttft_max_s"]
        assert t["serve_peak_rss_mb"] <= t["peak_rss_mb"] and t["gpu_peak_mb"] > 0
    h2o, summary = trials["h2o-32"], result["summary"]
    assert h2o["tokens_kept"] == BUDGET and h2o["tokens_seen"] > BUDGET
    assert summary["h2o-32"]["kv_mb"] <= summary["h2o-32"]["kv_bound_mb"]
    assert summary["stock"]["kv_mb"] == h2o["kvcache_mb"] > h2o["kv_mb"]
    assert summary["stock"]["ratio_vs_stock"] == 1.0
    pids = server_pids(lines)
    assert len(pids) == 2 and all(gone(pid) for pid in pids)


def test_interrupted_run_stops_its_server(tiny):
    proc = bench("--model", str(tiny), "--rounds", "3", "--budgets", str(BUDGET))
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
    prompts = load_script().make_prompts(tok, [300] * 6 + [64], seed=0)
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
    out = load_script().save_random_model(tmp_path / "m", "tiny-qwen3", 4,
                                          Path(resolve_model("smollm2-135m")))
    model, tokenizer = mlx_lm.load(str(out))
    assert json.loads((out / "config.json").read_text())["quantization"]["bits"] == 4
    logits = model(mx.array([tokenizer.encode("The cat sat on the mat")]))[0]
    assert (logits[:, 49152:] == 0).all() and (logits[:, :49152].max(-1) > 0).all()
    steps = generate_step(mx.array(tokenizer.encode("Hi")), model, max_tokens=20)
    tokens = [int(token) for token, _ in steps]
    assert len(tokens) == 20 and max(tokens) < 49152 and tokenizer.decode(tokens)
