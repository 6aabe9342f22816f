"""Named perplexity sets (tuning vs evaluation) and `mlx-h2o quality` on a tiny model."""

import json
import re

import mlx.core as mx
import pytest
from tiny_models import VOCAB, tiny_llama

from mlx_h2o.cli import main as cli_main
from mlx_h2o.eval import evalsets
from mlx_h2o.eval.evalsets import EVAL_SETS, EvalSet, eval_set, pooled


def test_tuning_and_evaluation_sets_are_apart():
    tuning, evaluation = eval_set("tuning"), eval_set("evaluation")
    assert tuning.corpora == ("austen",)
    assert set(evaluation.corpora) == {"python-docs", "sharegpt", "python-src",
                                       "shakespeare", "iso-codes"}
    assert not set(tuning.corpora) & set(evaluation.corpora)
    assert tuning.seeds != evaluation.seeds
    for es in (tuning, evaluation):  # the packaged models, the paper protocol
        assert es.models == ("smollm2-135m", "gemma3-270m", "qwen2.5-coder-0.5b")
        assert (es.num_samples, es.seq_len, es.prefill, es.max_kv) == (10, 512, 32, 256)


def test_set_flags_are_the_ppl_commands():
    from mlx_h2o.cli import ppl

    es = eval_set("evaluation")
    a = ppl.setup_arg_parser().parse_args(es.ppl_args("smollm2-135m", "sharegpt", 1))
    assert (a.corpus, a.num_samples, a.sequence_length, a.max_kv_size, a.seed, a.prefill) == (
        "sharegpt", 10, [512], [256], 1, 32)


def test_bad_sets_name_the_fix():
    with pytest.raises(ValueError, match=r"use one of \('tuning', 'evaluation'\)"):
        eval_set("test")
    with pytest.raises(ValueError, match="non-empty"):
        EvalSet("x", ())
    with pytest.raises(ValueError, match="num_samples must be >= 2"):
        EvalSet("x", ("austen",), num_samples=1)


def test_pooled_concatenates_windows():
    a = {"strategy": "s", "nll_per_sample": [1.0, 2.0]}
    b = {"strategy": "s", "nll_per_sample": [3.0]}
    assert pooled([a, b]) == {"strategy": "s", "nll_per_sample": [1.0, 2.0, 3.0], "nll": 2.0}


def test_summarize_ratios_against_the_reference():
    from mlx_h2o.cli.quality import summarize

    def row(name, nll):
        return {"strategy": name, "nll_per_sample": nll, "ppl": 1.0}

    by_corpus = {c: [row("baseline", [1.0, 1.1, 1.2]), row("rotating", [1.1, 1.2, 1.32]),
                     row("h2o", [1.03, 1.13, 1.24])] for c in ("a", "b")}
    rows = {(r["corpus"], r["strategy"]): r for r in summarize(by_corpus, "rotating")}
    assert set(rows) == {(c, s) for c in ("a", "b", "pooled") for s in ("rotating", "h2o")}
    h2o = rows[("pooled", "h2o")]
    assert h2o["ratio"] == pytest.approx((mx.exp(mx.array(0.0333333)) - 1).item()
                                         / (mx.exp(mx.array(0.1066667)) - 1).item(), rel=1e-3)
    assert "ratio" not in rows[("a", "rotating")]


def test_cli_runs_a_set_on_a_tiny_model(tmp_path, monkeypatch, capsys):
    from mlx_h2o.cli import ppl, quality

    tiny = EvalSet("tiny", ("austen", "python-src"), models=("m",), num_samples=3,
                   seq_len=48, prefill=8, max_kv=24)
    monkeypatch.setitem(EVAL_SETS, "tiny", tiny)
    monkeypatch.setattr(quality, "load_model_or_fail", lambda *a, **k: (tiny_llama(), None))
    monkeypatch.setattr(quality, "ensure_corpus_or_fail", lambda *a: None)
    monkeypatch.setattr(ppl, "load_data", lambda tok, args: {
        args.sequence_length[0]: mx.random.randint(0, VOCAB, (
            args.num_samples, args.sequence_length[0]), key=mx.random.key(len(args.corpus)))})
    argv = ["quality", "--set", "tiny", "--strategies", "baseline", "rotating",
            "h2o-heavy-tova", "--results-dir", str(tmp_path), "--no-progress"]
    assert cli_main(argv) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    got = [(r["corpus"], r["strategy"]) for r in out["rows"]]
    assert got == [(c, s) for c in ("austen", "python-src", "pooled")
                   for s in ("rotating", "h2o-heavy-tova")]
    assert all("ratio" in r for r in out["rows"] if r["strategy"] != "rotating")
    assert len(list(tmp_path.glob("ppl/m-*/"))) == 2  # one `mlx-h2o ppl` folder a corpus


def test_small_run_flags_shrink_the_protocol(tmp_path, monkeypatch, capsys):
    """--models / --corpora / -n / --sequence-length / --max-kv-size: a run of
    one model, one corpus, 2 windows of 40 tokens at 20 (the set has 2 x 3 x 10
    x 512 at 256); its units are those of the matching `mlx-h2o ppl` run."""
    from mlx_h2o.cli import ppl, quality

    seen = []
    monkeypatch.setattr(quality, "load_model_or_fail",
                        lambda parser, name, flag: seen.append(name) or (tiny_llama(), None))
    monkeypatch.setattr(quality, "ensure_corpus_or_fail", lambda *a: None)
    monkeypatch.setattr(ppl, "load_data", lambda tok, args: {args.sequence_length[0]: (
        mx.random.randint(0, VOCAB, (args.num_samples, args.sequence_length[0]),
                          key=mx.random.key(0)))})
    argv = ["quality", "--models", "gemma3-270m", "--corpora", "sharegpt", "-n", "2",
            "--sequence-length", "40", "--max-kv-size", "20", "--results-dir", str(tmp_path),
            "--no-progress"]
    assert cli_main(argv) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].endswith("n=2 seq_len=40 prefill=32 max_kv=20")
    out = json.loads(lines[-1])
    assert seen == ["gemma3-270m"]
    assert [(r["corpus"], r["strategy"]) for r in out["rows"]] == [
        (c, s) for c in ("sharegpt", "pooled") for s in ("rotating", "h2o-heavy")]
    (folder,) = tmp_path.glob("ppl/gemma3-270m-sharegpt-decode-*/")
    units = sorted(p.name for p in folder.glob("*-L*.json"))
    assert units[0] == "baseline-L40.json" and units[2] == "rotating-kv20-L40.json"
    assert re.fullmatch(r"h2o-heavy-\w{6}-kv20-L40\.json", units[1]) and len(units) == 3


def test_cli_refuses_what_the_set_lacks(capsys):
    for argv, want in ((["--models", "llama"], "models ['llama'] not in the set"),
                       (["--strategies", "rotating"], "the first must be baseline"),
                       (["-n", "1"], "num_samples must be >= 2 (paired standard errors)"),
                       (["--sequence-length", "32"], "more than the set's 32-token prefill"),
                       (["--sequence-length", "200"], "--max-kv-size 256: no strategy "
                        "evicts in a window of --sequence-length 200")):
        with pytest.raises(SystemExit):
            cli_main(["quality", *argv])
        err = capsys.readouterr().err.strip()
        assert err.startswith("mlx-h2o quality: error: ") and want in err, err


def test_python_src_corpus_skips_tests_and_small_files(tmp_path):
    from mlx_h2o.eval import corpora

    (tmp_path / "pkg" / "tests").mkdir(parents=True)
    (tmp_path / "os.py").write_text("x = 1\n" * 400)
    (tmp_path / "pkg" / "mod.py").write_text("def f():\n    return 2\n" * 200)
    (tmp_path / "pkg" / "tests" / "test_mod.py").write_text("assert True\n" * 400)
    (tmp_path / "tiny.py").write_text("y = 2\n")
    docs = corpora.load_python_src(tmp_path)
    assert [d[:5] for d in docs] == ["x = 1", "def f"]
    corpora.check_corpus("python-src")  # this Python's own standard library
    with pytest.raises(ValueError, match="no Python modules"):
        corpora.load_python_src(tmp_path, min_chars=10**6)
