"""H2O under mlx-lm's tensor and pipeline parallelism: two local processes over
MLX's ring backend (`mlx.launch` on 127.0.0.1) against one process.

Tiny random models saved as mlx-lm model folders (a llama and a qwen2, 2 KV
heads and 4 query heads each) decode greedily past an H2O budget. Launched,
rank r holds KV heads [r*Hk/2, (r+1)*Hk/2) of every layer (tensor parallel)
or, pipelined, the layers mlx-lm gives it (the last rank the first layers):
the tokens and each (layer, head)'s kept positions must equal the single
process's, and the cache stats (KV bytes of all ranks) its totals. Then
`mlx-h2o generate` and `mlx-h2o serve` under `mlx.launch`. Every launch has a
timeout and is stopped with its process group; the ring binds 127.0.0.1 only.
"""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten, tree_map
from mlx_lm.models import qwen2
from tiny_models import tiny_llama

import distributed_worker as worker

BIN = Path(sys.executable).parent
LAUNCH = BIN / "mlx.launch"
OPENBLAS = "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0"
TIMEOUT = 120  # seconds per launch
HK, RANKS = 2, 2
LLAMA = dict(model_type="llama", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
             num_attention_heads=4, num_key_value_heads=HK, rms_norm_eps=1e-5,
             vocab_size=49152, head_dim=32, rope_theta=10000.0, tie_word_embeddings=True)
QWEN2 = dict(model_type="qwen2", hidden_size=64, num_hidden_layers=4, intermediate_size=128,
             num_attention_heads=4, num_key_value_heads=HK, rms_norm_eps=1e-6,
             vocab_size=49152, rope_theta=10000.0, max_position_embeddings=4096,
             tie_word_embeddings=True)
TEXT = ("the cat sat on a mat while seven dogs ran over green hills near old river towns "
        "and every child sang songs about bright stars the cat sat on a mat")
H2O_FLAGS = ["--max-kv-size", "16", "--h2o-sink-size", "2"]

pytestmark = pytest.mark.skipif(
    not (LAUNCH.exists() and mx.distributed.is_available("ring")),
    reason=f"MLX's ring backend or {LAUNCH} is missing in the installed mlx")


def save_model(path: Path, config: dict, model, index: bool = False) -> str:
    """An mlx-lm model folder with SmolLM2's packaged tokenizer; ``index``: a
    weight index (mlx-lm's pipelined sharded_load reads it)."""
    from mlx_h2o.models import resolve_model

    path.mkdir(parents=True)
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(path / "model.safetensors"), weights)
    if index:
        index_json = {"weight_map": {k: "model.safetensors" for k in weights}}
        (path / "model.safetensors.index.json").write_text(json.dumps(index_json))
    (path / "config.json").write_text(json.dumps(config))
    source = Path(resolve_model("smollm2-135m"))
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(source / name, path / name)
    return str(path)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from mlx_h2o.profiles import LayerProfile, save_profile

    tmp = tmp_path_factory.mktemp("distributed")
    llama = save_model(tmp / "llama", LLAMA, tiny_llama(**LLAMA))
    mx.random.seed(1)
    pipe = qwen2.Model(qwen2.ModelArgs.from_dict(QWEN2))
    pipe.update(tree_map(lambda w: mx.random.normal(w.shape) * 0.3, pipe.parameters()))
    pipelined = save_model(tmp / "qwen2", QWEN2, pipe, index=True)
    profile = LayerProfile(statistic="invtopk", weights=(3.0, 1.0), attention_layers=2,
                           windows=(None, None), model_type="llama")
    return {"llama": llama, "qwen2": pipelined,
            "profile": str(save_profile(profile, tmp / "profile.json")), "tmp": tmp}


def free_ports(n: int) -> int:
    """The first of ``n`` consecutive free ports on 127.0.0.1."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            first = s.getsockname()[1]
        if first + n < 65536 and all(_free(first + k) for k in range(1, n)):
            return first
    raise RuntimeError("no consecutive free ports on 127.0.0.1")


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def launch_argv(argv, n=RANKS) -> list:
    return [sys.executable, str(LAUNCH), "--backend", "ring", "--hosts", "127.0.0.1",
            "-n", str(n), "--starting-port", str(free_ports(n)), "--python", sys.executable,
            "--", *argv]


def launch_env() -> dict:
    env = dict(os.environ)
    if Path(OPENBLAS).exists():  # as the Makefile: the CLI then runs without re-executing
        env["LD_PRELOAD"] = OPENBLAS
    return env


def stop(proc: subprocess.Popen) -> None:
    """The launcher and its ranks (one process group, started here)."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


def launch(argv, n=RANKS) -> str:
    """stdout + stderr of ``argv`` run on ``n`` ranks (mlx.launch exits 0 even
    when a rank fails: callers check what was printed)."""
    proc = subprocess.Popen(launch_argv(argv, n), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=launch_env(),
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        stop(proc)
        pytest.fail(f"{argv[:2]} under mlx.launch did not finish in {TIMEOUT} s")
    return out


# --- the library: tokens and kept positions, rank by rank --------------------------------
@pytest.fixture(scope="module")
def runs(models):
    """(one process's results, [rank 0's, rank 1's])."""
    prefix = models["tmp"] / "run"
    args = [models["llama"], models["qwen2"], models["profile"]]
    out = launch([str(Path(worker.__file__).resolve()), *args, f"{prefix}-launched"])
    ranks = []
    for r in range(RANKS):
        path = Path(f"{prefix}-launched.{r}.json")
        assert path.exists(), f"rank {r} wrote no result:\n{out[-3000:]}"
        ranks.append(json.loads(path.read_text()))
    worker.main(*args, f"{prefix}-one")
    return json.loads(Path(f"{prefix}-one.0.json").read_text()), ranks


def joined_heads(ranks, case):
    """Per layer, (B, Hk, slots): rank r's heads are [r*Hk/R, (r+1)*Hk/R)."""
    layers = []
    for per_rank in zip(*(r[case]["kept"] for r in ranks)):
        assert all(len(k[0]) == HK // RANKS for k in per_rank)  # (B, local heads, slots)
        layers.append([sum((k[b] for k in per_rank), []) for b in range(len(per_rank[0]))])
    return layers


@pytest.mark.parametrize("case", list(worker.CASES))
def test_tensor_parallel_keeps_what_one_process_keeps(runs, case):
    one, ranks = runs
    assert one["ranks"] == 1 and all(r["ranks"] == RANKS for r in ranks)
    assert all(r[case]["tokens"] == one[case]["tokens"] for r in ranks)
    assert joined_heads(ranks, case) == one[case]["kept"]
    evicted = one[case]["stats"]["layer_evicted"]
    assert min(evicted) > 0  # the budget evicted in every layer
    for r in ranks:  # KV bytes of all ranks; per-head token counts as one process's
        assert r[case]["stats"] == {**one[case]["stats"], "ranks": RANKS}


def test_per_layer_budgets_are_the_same_on_every_rank(runs):
    one, ranks = runs
    budgets = one["q8_profile"]["stats"]["layer_budget"]
    assert len(set(budgets)) == 2 and sum(budgets) == 2 * 16  # the profile's sizes
    for layer, size in enumerate(budgets):
        for r in ranks:
            assert len(r["q8_profile"]["kept"][layer][0][0]) == size


def test_pipeline_parallel_keeps_what_one_process_keeps(runs):
    one, ranks = runs
    layers = QWEN2["num_hidden_layers"]
    assert all(r["pipeline"]["tokens"] == one["pipeline"]["tokens"] for r in ranks)
    # The last rank holds the first layers (mlx-lm's pipeline split).
    in_order = [k for r in reversed(ranks) for k in r["pipeline"]["kept"]]
    assert len(in_order) == layers and in_order == one["pipeline"]["kept"]
    assert [len(r["pipeline"]["kept"]) for r in ranks] == [layers // RANKS] * RANKS
    stats = one["pipeline"]["stats"]
    assert min(stats["layer_evicted"]) > 0
    for r in ranks:  # layers joined over the ranks: the one process's stats
        assert r["pipeline"]["stats"] == {**stats, "ranks": RANKS}


# --- the commands --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def reference(models):
    """One process: (text, KV bytes) of TEXT's greedy continuation, as
    `mlx-h2o generate --ignore-chat-template` and a text completion see it."""
    from mlx_lm.utils import load

    from mlx_h2o import H2OConfig, cache_stats, generate, make_h2o_cache

    model, tokenizer = load(models["llama"])
    cache = make_h2o_cache(model, H2OConfig(max_size=16, sink_size=2), layer_budget="uniform")
    text = generate(model, tokenizer, tokenizer.encode(TEXT), prompt_cache=cache,
                    max_tokens=10)
    return text, cache_stats(cache)


def test_generate_under_launch_prints_once(models, reference):
    text, stats = reference
    cli = str(BIN / "mlx-h2o")
    out = launch([cli, "generate", "--model", models["llama"], "--prompt", TEXT,
                  "--ignore-chat-template", "--max-tokens", "10", *H2O_FLAGS])
    assert out.count("==========") == 2, out[-3000:]
    assert out.split("==========")[1].strip() == text.strip()
    summary = [line for line in out.splitlines() if "H2O cache" in line]
    assert len(summary) == 1, out[-3000:]
    want = stats.summary().replace("layers)", f"layers, KV bytes of {RANKS} ranks)")
    assert summary[0].endswith(want)


def test_heads_that_do_not_divide_end_with_one_line(capsys, models):
    from mlx_h2o.cli import generate
    from mlx_h2o.cli.ranks import load_on_ranks
    from mlx_h2o.integration.distributed import check_heads_divide

    class ThreeRanks:  # what mx.distributed.init() gives rank 0 of three
        def size(self):
            return 3

        def rank(self):
            return 0

    parser = generate.setup_arg_parser()
    args = parser.parse_args(["--model", models["llama"]])
    with pytest.raises(SystemExit) as exit_:
        load_on_ranks(parser, args, ThreeRanks(), models["llama"])
    err = capsys.readouterr().err.strip()
    assert exit_.value.code == 2 and "\n" not in err
    assert "has 2 KV heads" in err and "over 3 ranks" in err and "run on 2 ranks" in err
    smollm2 = {"num_attention_heads": 9, "num_key_value_heads": 3}
    with pytest.raises(ValueError, match="3 KV heads .* over 2 ranks.*run on 3 ranks"):
        check_heads_divide(smollm2, 2, "smollm2-135m")
    check_heads_divide(smollm2, 3, "smollm2-135m")


def test_serve_under_launch(models, reference):
    text, stats = reference
    port = free_ports(1)
    argv = [str(BIN / "mlx-h2o"), "serve", "--model", models["llama"], "--host", "127.0.0.1",
            "--port", str(port), *H2O_FLAGS]
    log = open(models["tmp"] / "serve.log", "w+")
    proc = subprocess.Popen(launch_argv(argv), stdout=log, stderr=subprocess.STDOUT,
                            env=launch_env(), start_new_session=True)
    try:
        wait_ready(port, proc, log)
        batched = complete(port, {})
        assert batched["choices"][0]["text"] == text
        assert batched["usage"]["h2o"]["kv_bytes"] == stats.kv_bytes  # both ranks' caches
        # Served alone (stream_generate), from the first request's compressed
        # prompt cache: its text may differ from a fresh cache's.
        alone = complete(port, {"seed": 3})
        for usage in (batched["usage"]["h2o"], alone["usage"]["h2o"]):
            assert usage["tokens_kept"] == 16 and usage["tokens_evicted"] > 0
        assert batched["usage"]["h2o"]["batched"] and not alone["usage"]["h2o"]["batched"]
        logged = wait_logged(log, "H2O cache of a finished request", 2)
    finally:
        stop(proc)
        log.close()
    assert logged == 2  # by rank 0 only


def complete(port: int, extra: dict) -> dict:
    body = {"prompt": TEXT, "max_tokens": 10, "temperature": 0.0, **extra}
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions", data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=TIMEOUT) as r:
        return json.loads(r.read())


def wait_logged(log, line: str, n: int, timeout=10) -> int:
    """How often ``line`` is in the log once it is there ``n`` times (or after
    ``timeout``), a second later: the launcher relays the ranks' output."""
    end = time.time() + timeout
    while time.time() < end and _read(log).count(line) < n:
        time.sleep(0.2)
    time.sleep(1)
    return _read(log).count(line)


def _read(log) -> str:
    log.seek(0)
    return log.read()


def wait_ready(port: int, proc, log, timeout=TIMEOUT) -> None:
    end = time.time() + timeout
    while time.time() < end:
        if proc.poll() is not None:
            pytest.fail(f"the launched server exited:\n{_read(log)[-3000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.3)
    pytest.fail(f"the launched server was not ready in {timeout} s")


def test_decode_benchmark_runs_on_cpu(capsys):
    """benchmarks/distributed_decode.py's smoke run (one process, tiny shapes)."""
    import importlib.util

    path = Path(__file__).parents[1] / "benchmarks" / "distributed_decode.py"
    spec = importlib.util.spec_from_file_location("distributed_decode", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert bench.main(["--shape", "tiny", "--bits", "0", "--dtype", "float32",
                       "--contexts", "200:128", "--rounds", "1", "--steps", "2"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].startswith("mlx=") and "ranks=1" in lines[0]
    rows = json.loads(lines[-1])["results"][0]["rows"]
    assert set(rows) == set(bench.STRATEGIES) and all(r[0]["tok_s"] > 0 for r in rows.values())
