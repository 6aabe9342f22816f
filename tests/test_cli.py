"""`mlx-h2o generate`: flags, a real run on the default model; cache stats."""

from pathlib import Path

import mlx.core as mx
import pytest
from mlx_lm.models.cache import load_prompt_cache as load_mlx_lm_cache
from mlx_lm.models.cache import RotatingKVCache, make_prompt_cache
from tiny_models import VOCAB, tiny_gemma3, tiny_llama

import mlx_h2o
from mlx_h2o import cache_stats, make_h2o_cache
from mlx_h2o.files import load_prompt_cache, save_prompt_cache
from mlx_h2o.cli import main as cli_main
from mlx_h2o.cli.generate import (
    h2o_config_from_args,
    quant_config_from_args,
    setup_arg_parser,
)
from mlx_h2o.cli.h2o_args import h2o_value
from mlx_h2o.config import H2OConfig


def parse(*argv):
    return setup_arg_parser().parse_args(list(argv))


def test_h2o_flags_build_the_config():
    args = parse("--h2o-max-size", "64", "--h2o-heavy-budget", "20", "--h2o-sink-size", "2",
                 "--h2o-score", "normalized", "--h2o-prefill-window", "0")
    cfg = h2o_config_from_args(args)
    assert (cfg.max_size, cfg.heavy_budget, cfg.recent_budget, cfg.sink_size) == (64, 20, 42, 2)
    assert cfg.score == "normalized" and cfg.prefill_window == 0
    assert h2o_config_from_args(parse()) == H2OConfig(max_size=256)  # library defaults
    assert h2o_config_from_args(parse("--no-h2o")) is None
    assert h2o_config_from_args(parse("--h2o-evict-batch", "16")).evict_batch == 16
    with pytest.raises(ValueError, match="evict_batch"):  # more than the 128 heavy slots
        h2o_config_from_args(parse("--h2o-evict-batch", "129"))
    assert h2o_value(parse(), "h2o_layer_budget") == "uniform"
    assert parse("--h2o-layer-budget", "uniform").h2o_layer_budget == "uniform"
    # Every mlx_lm.generate flag is still there.
    args = parse("--temp", "0.7", "--top-k", "5", "--prefill-step-size", "64", "--max-kv-size", "9")
    assert (args.temp, args.top_k, args.prefill_step_size, args.max_kv_size) == (0.7, 5, 64, 9)


def test_quant_flags():
    assert quant_config_from_args(parse()) is None
    q = quant_config_from_args(parse("--h2o-kv-bits", "8", "--h2o-kv-recent-bits", "4"))
    assert (q.bits, q.recent_bits, q.group_size, q.mixed) == (8, 4, 64, True)
    with pytest.raises(ValueError, match="needs --h2o-kv-bits"):
        quant_config_from_args(parse("--h2o-kv-recent-bits", "4"))
    with pytest.raises(SystemExit):
        parse("--h2o-kv-bits", "3")


def test_conflicting_budgets_are_refused():
    with pytest.raises(ValueError, match="budgets|must equal"):
        h2o_config_from_args(parse("--h2o-max-size", "10", "--h2o-heavy-budget", "5",
                                   "--h2o-recent-budget", "5"))


def test_unknown_command(capsys):
    assert cli_main(["nope"]) == 2
    assert "unknown command" in capsys.readouterr().err
    assert cli_main([]) == 2  # a missing command is a usage error, as in argparse
    out, err = capsys.readouterr()
    assert out == "" and err.startswith("usage: mlx-h2o <command>") and "generate" in err
    assert cli_main(["--help"]) == 0 and "usage: mlx-h2o" in capsys.readouterr().out


@pytest.mark.real_model
def test_generate_on_default_model_evicts(capsys):
    prompt = (Path(__file__).parents[1] / "docs" / "demo_prompt.txt").read_text()
    assert cli_main(["generate", "--prompt", prompt, "--max-tokens", "12",
                     "--max-kv-size", "96"]) == 0
    out = capsys.readouterr().out
    # 331 tokens through each of SmolLM2's 30 layers (3 KV heads of 64 float32s:
    # K+V 1,536 bytes a token and layer, 46,080 over the layers), 96 kept in each.
    line = next(l for l in out.splitlines() if l.startswith("Prompt: ") and "H2O" in l)
    assert ("H2O cache (tokens a layer, mean over 30 layers): seen 331 = kept 96 + "
            "evicted 235; budget 96 a layer") in line
    held, exact, allocated = 30 * 96 * (1536 + 3 * 12), 331 * 46080, 512 * 46080
    assert (f"KV {held / 2**20:.2f} MiB ({exact / held:.2f}x less); mlx-lm's KVCache: "
            f"{exact / 2**20:.2f} MiB for the 331 tokens ({allocated / 2**20:.2f} MiB "
            "allocated in 256-token steps)") in line
    assert "Layer budget (uniform): 96 tokens in every layer" in out
    # The shipped profile on request: the same memory, shared unevenly.
    assert cli_main(["generate", "--prompt", prompt, "--max-tokens", "1", "--max-kv-size",
                     "96", "--h2o-layer-budget", "auto"]) == 0
    out = capsys.readouterr().out
    assert ("Layer budget (auto): 48..131 tokens a layer, mean 96 (--max-kv-size), total "
            "2880 over 30 layers; the smallest evict past 48 tokens") in out
    assert "kept 96 (48..131 by layer)" in out and "budget 48..131, mean 96 a layer" in out


@pytest.mark.real_model
def test_generate_verbose_false_prints_only_the_text(capsys):
    assert cli_main(["generate", "--prompt", "Hello", "--max-tokens", "5", "--verbose",
                     "False", "--max-kv-size", "16"]) == 0
    out = capsys.readouterr().out
    assert out.strip() and "H2O cache" not in out and "Layer budget" not in out
    assert "tokens-per-sec" not in out


def _run(model, cache, tokens, prefill):
    with mlx_h2o.patch():
        model(tokens[:, :prefill], cache=cache)
        for t in range(prefill, tokens.shape[1]):
            model(tokens[:, t : t + 1], cache=cache)


def _held_bytes(c) -> int:
    """K/V bytes of the tokens an mlx-lm cache holds (a RotatingKVCache: its window)."""
    n = min(c.offset, c.max_size) if isinstance(c, RotatingKVCache) else c.offset
    return n * (c.keys.nbytes + c.values.nbytes) // c.keys.shape[2]


@pytest.mark.parametrize("builder", [tiny_llama, tiny_gemma3])
@pytest.mark.parametrize("prefill, decode", [(20, 3), (256, 1), (10, 260)])
def test_stats_add_up_and_match_what_mlx_lm_holds(builder, prefill, decode):
    model = builder()
    tokens = mx.random.randint(0, VOCAB, (1, prefill + decode), key=mx.random.key(1))
    plain = make_prompt_cache(model)  # mlx-lm's KVCache / RotatingKVCache
    h2o = make_h2o_cache(model, H2OConfig(max_size=64), layer_budget="uniform")
    _run(model, plain, tokens, prefill)
    _run(model, h2o, tokens, prefill)
    stats = cache_stats(h2o)
    # what mlx-lm's caches allocate, and the K/V they hold for the tokens
    assert stats.kvcache_allocated_bytes == sum(c.nbytes for c in plain)
    assert stats.kvcache_bytes == sum(_held_bytes(c) for c in plain)
    for seen, kept, evicted in zip(stats.layer_seen, stats.layer_kept, stats.layer_evicted):
        assert seen == kept + evicted == prefill + decode
    assert stats.tokens_seen == prefill + decode
    assert stats.tokens_kept + stats.tokens_evicted == pytest.approx(stats.tokens_seen)
    assert f"seen {prefill + decode} = kept {stats.tokens_kept}" in stats.summary()


def test_stats_of_a_loaded_cache(tmp_path):
    model = tiny_llama()
    cache = make_h2o_cache(model, H2OConfig(max_size=24))
    _run(model, cache, mx.random.randint(0, VOCAB, (1, 40), key=mx.random.key(2)), 30)
    save_prompt_cache(str(tmp_path / "c.safetensors"), cache)
    loaded = cache_stats(load_prompt_cache(str(tmp_path / "c.safetensors")))
    before = cache_stats(cache)
    assert loaded.kvcache_bytes == before.kvcache_bytes > 0
    assert loaded.kvcache_allocated_bytes == before.kvcache_allocated_bytes
    assert loaded.summary().split(" | ")[0] == before.summary().split(" | ")[0]


@pytest.mark.real_model
def test_cache_prompt_then_generate(tmp_path, capsys):
    h2o, plain = str(tmp_path / "h2o.safetensors"), str(tmp_path / "plain.safetensors")
    prompt = "The lighthouse keeper counted the ships. " * 12
    assert cli_main(["cache_prompt", "--prompt", prompt, "--prompt-cache-file", h2o,
                     "--max-kv-size", "32"]) == 0
    assert "kept 32 " in capsys.readouterr().out
    assert cli_main(["generate", "--prompt-cache-file", h2o, "--prompt", "How many?",
                     "--max-tokens", "4"]) == 0
    out = capsys.readouterr().out
    assert f"Layer budget (from {h2o}): 32 tokens in every layer" in out
    # --no-h2o: mlx-lm's own file, which mlx-lm's loader reads
    assert cli_main(["cache_prompt", "--no-h2o", "--prompt", prompt,
                     "--prompt-cache-file", plain]) == 0
    cache, meta = load_mlx_lm_cache(plain, return_metadata=True)
    assert type(cache[0]).__name__ == "KVCache" and Path(meta["model"]).is_dir()
    capsys.readouterr()
    assert cli_main(["generate", "--no-h2o", "--prompt-cache-file", plain, "--prompt",
                     "How many?", "--max-tokens", "4", "--verbose", "False"]) == 0
    assert capsys.readouterr().out.strip()


def test_cache_prompt_errors(capsys):
    base = ["cache_prompt", "--prompt", "hi", "--prompt-cache-file"]
    for argv, want in [(base + ["c.safetensors", "--max-kv-size", "9", "--h2o-max-size",
                                "8"], "--max-kv-size 9 and --h2o-max-size 8 (its old"),
                       (base + ["c.bin"], "must end with .safetensors"),
                       (base + ["c.safetensors", "--h2o-recent-budget", "0"],
                        "--h2o-recent-budget must be >= 1")]:
        with pytest.raises(SystemExit) as e:
            cli_main(argv)
        err = capsys.readouterr().err
        assert e.value.code == 2 and len(err.splitlines()) == 1 and want in err, err


def test_help_starts_once(monkeypatch, capsys):
    """Help is printed without the OpenBLAS re-exec (which would start the program twice)."""
    def reexec():
        raise AssertionError("re-exec for --help")

    monkeypatch.setattr("mlx_h2o.blas.reexec_with_openblas", reexec)
    for argv in (["mlx-h2o"], ["mlx-h2o", "--help"], ["mlx-h2o", "nope"]):
        monkeypatch.setattr("sys.argv", argv)
        assert cli_main() in (0, 2)
    monkeypatch.setattr("sys.argv", ["mlx-h2o", "prepare", "--help"])
    with pytest.raises(SystemExit):
        cli_main()
    assert "usage: mlx-h2o prepare" in capsys.readouterr().out
