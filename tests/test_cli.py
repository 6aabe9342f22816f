"""`mlx-h2o generate`: flags, errors, and one real run on the default model."""

from pathlib import Path

import pytest

from mlx_h2o.cli import main as cli_main
from mlx_h2o.cli.generate import (
    _check_unsupported,
    h2o_config_from_args,
    quant_config_from_args,
    setup_arg_parser,
)
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
    assert parse().h2o_layer_budget == "auto"
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


def test_conflicting_flags_are_refused():
    args = parse("--max-kv-size", "128")
    with pytest.raises(ValueError, match="both bound the cache"):
        _check_unsupported(args, h2o_config_from_args(args))
    with pytest.raises(ValueError, match="budgets|must equal"):
        h2o_config_from_args(parse("--h2o-max-size", "10", "--h2o-heavy-budget", "5",
                                   "--h2o-recent-budget", "5"))


def test_unknown_command(capsys):
    assert cli_main(["nope"]) == 2
    assert "unknown command" in capsys.readouterr().err
    assert cli_main([]) == 0 and "generate" in capsys.readouterr().out


@pytest.mark.real_model
def test_generate_on_default_model_evicts(capsys):
    prompt = (Path(__file__).parents[1] / "docs" / "demo_prompt.txt").read_text()
    assert cli_main(["generate", "--prompt", prompt, "--max-tokens", "12",
                     "--h2o-max-size", "96"]) == 0
    out = capsys.readouterr().out
    line = next(l for l in out.splitlines() if "H2O cache:" in l)
    assert "evicted=" in line and "evicted=0 " not in line
    # --h2o-layer-budget auto (default): the shipped profile's per-layer sizes
    assert "Layer budget (auto): per-layer max_size 48..131, total 2880 over 30" in out
    assert "kept=131" in line
