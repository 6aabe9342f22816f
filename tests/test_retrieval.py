"""The retrieval suite: RULER-style prompts, scoring, and runs on a tiny model."""

import json

import pytest
from tiny_models import VOCAB, tiny_llama

from mlx_h2o.cli import main as cli_main
from mlx_h2o.eval import passkey, retrieval
from mlx_h2o.eval.retrieval_data import (
    TASKS,
    chat_frame,
    make_retrieval_prompt,
    score_output,
)
from mlx_h2o.eval.strategies import parse_strategy


class CharTokenizer:
    """Printable ASCII, one token per character (fits the tiny models' vocab)."""

    def encode(self, text, add_special_tokens=True):
        return [ord(c) - 32 for c in text if 32 <= ord(c) < 32 + VOCAB]

    def decode(self, ids):
        return "".join(chr(i + 32) for i in ids)


class ChatTokenizer(CharTokenizer):
    chat_template = "<u>{content}</u><a>"

    def apply_chat_template(self, messages, tokenize, add_generation_prompt):
        assert not tokenize and add_generation_prompt
        return f"<u>{messages[0]['content']}</u><a>"


HAY = "Rain fell on the hills. The river ran high. Birds sang at noon."


@pytest.mark.parametrize("task", TASKS)
def test_prompt_is_exact_and_holds_every_answer(task):
    tok = CharTokenizer()
    p = make_retrieval_prompt(tok, task, 900, 0.5, seed=3, haystack=HAY)
    text = tok.decode(p["tokens"])
    assert len(p["tokens"]) == 900 and p["task"] == task
    assert p["answers"] and all(a in text for a in p["answers"])
    # Needles sit inside the haystack, the question and answer prefix at the end.
    assert text.rstrip().endswith(("is", "are", "by", "to", "they are:"))
    again = make_retrieval_prompt(tok, task, 900, 0.5, seed=3, haystack=HAY)
    assert again["tokens"] == p["tokens"], "a seed gives one prompt"


@pytest.mark.parametrize("depth", [0.1, 0.5, 0.9])
def test_single_needle_sits_at_its_depth(depth):
    tok = CharTokenizer()
    p = make_retrieval_prompt(tok, "single", 2000, depth, seed=1, haystack=HAY)
    text = tok.decode(p["tokens"])
    start, end = text.index("afterwards.") + 11, text.index("What is")  # the haystack
    at = (text.index(p["answers"][0]) - start) / (end - start)
    assert abs(at - depth) < 0.05


def test_vartrack_chain_is_in_order():
    tok = CharTokenizer()
    p = make_retrieval_prompt(tok, "vartrack", 1500, 0.5, seed=7, haystack=HAY)
    text = tok.decode(p["tokens"])
    names = p["answers"]
    starts = [text.index(f"VAR {n} =") for n in names]
    assert starts == sorted(starts) and len(names) == 5
    assert p["needle_depths"] == sorted(p["needle_depths"])


def test_chat_template_wraps_the_user_message_and_the_answer_follows():
    tok = ChatTokenizer()
    assert [tok.decode(t) for t in chat_frame(tok)] == ["<u>", "</u><a>"]
    p = make_retrieval_prompt(tok, "docqa", 800, 0.5, seed=0, haystack=HAY)
    text = tok.decode(p["tokens"])
    assert text.startswith("<u>Answer the question") and "?</u><a>" in text
    assert text.endswith("was founded by")
    plain = make_retrieval_prompt(tok, "docqa", 800, 0.5, seed=0, haystack=HAY, chat=False)
    assert "<u>" not in tok.decode(plain["tokens"]) and len(plain["tokens"]) == 800


def test_bad_input_names_the_fix():
    tok = CharTokenizer()
    with pytest.raises(ValueError, match="use one of"):
        make_retrieval_prompt(tok, "needle", 900, 0.5, 0)
    with pytest.raises(ValueError, match=r"depth must be in \[0, 1\]"):
        make_retrieval_prompt(tok, "single", 900, 1.5, 0)
    with pytest.raises(ValueError, match="too short"):
        make_retrieval_prompt(tok, "vartrack", 200, 0.5, 0)
    with pytest.raises(ValueError, match="use some of"):
        retrieval.make_prompts(tok, ["single", "nope"], [900], [0.5])


def test_score_output():
    assert score_output(" 123 and 456.", ["123", "456"]) == (True, 1.0)
    assert score_output("Clara winslow", ["Clara Winslow"]) == (True, 1.0)
    assert score_output(" 123 only", ["123", "456"]) == (False, 0.5)


def test_tasks_run_as_passkey_trials_batched_or_not():
    model, tok = tiny_llama(), CharTokenizer()
    prompts = retrieval.make_prompts(tok, ["single", "multivalue"], [640], [0.2, 0.8],
                                     haystack=HAY)
    st = parse_strategy("h2o-heavy")
    together = passkey.run_strategy(model, tok, prompts, st, 160, prefill_step=256,
                                    new_tokens=4)
    alone = passkey.run_strategy(model, tok, prompts, st, 160, prefill_step=256,
                                 new_tokens=4, batch_size=1)
    assert [t["output"] for t in together["trials"]] == [t["output"] for t in alone["trials"]]
    assert [t["task"] for t in together["trials"]] == ["single"] * 2 + ["multivalue"] * 2
    acc = retrieval.task_accuracy(together)
    assert set(acc) == {"single", "multivalue", "mean"}
    assert acc["mean"] == pytest.approx((acc["single"] + acc["multivalue"]) / 2)
    # An output that holds the answers counts.
    row = passkey.score_trial(prompts[0], " ".join(prompts[0]["answers"]))
    assert row["correct"] and row["recall"] == 1.0
    # Text after the end of the model's turn is not its answer.
    late = passkey.score_trial(prompts[0] | {"stop": "</s>"},
                               " no.</s> " + " ".join(prompts[0]["answers"]))
    assert not late["correct"] and late["output"].endswith(prompts[0]["answers"][0])


def test_cli_writes_tables_and_heatmaps(tmp_path, monkeypatch, capsys):
    from mlx_h2o.cli import retrieval as cli

    monkeypatch.setattr(cli, "load_model_or_fail", lambda *a, **k: (tiny_llama(),
                                                                    CharTokenizer()))
    argv = ["retrieval", "--model", "tiny", "--contexts", "400", "--tasks", "single",
            "sentence", "--depths", "0.5", "--budgets", "0.25", "0.5", "--haystack",
            "noise", "--new-tokens", "3", "--strategies", "baseline", "rotating",
            "h2o-heavy-tova", "--results-dir", str(tmp_path), "--no-progress"]
    monkeypatch.setattr("mlx_h2o.cli.passkey.check_model_arg", lambda *a: None)
    monkeypatch.setattr(cli, "load_tokenizer_or_fail", lambda *a: CharTokenizer())
    assert cli_main(argv) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [(r["strategy"], r["max_kv"]) for r in out["rows"]] == [
        ("baseline", None), ("rotating", 100), ("h2o-heavy-tova", 100),
        ("rotating", 200), ("h2o-heavy-tova", 200)]
    assert all(0 <= r["mean"] <= 1 for r in out["rows"])
    # Every bounded row says how many of the baseline's answers it kept.
    for r in out["rows"][1:]:
        k, n = map(int, r["kept"].split("/"))
        assert 0 <= k <= n and r["kept_frac"] == (k / n if n else None)
    if pytest.importorskip("matplotlib"):
        assert list((tmp_path / "retrieval").glob("*/retrieval_ctx400.png"))


def test_cli_reports_the_baselines_answers_kept(tmp_path, monkeypatch, capsys):
    from mlx_h2o.cli import retrieval as cli

    # The tiny model answers nothing: call every output of a bounded cache at
    # the first depth wrong, every other output right.
    def score(prompt, output):
        return {"task": prompt["task"], "depth": prompt["depth"], "context": prompt["context"],
                "output": output, "correct": not (prompt["depth"] == 0.2 and bounded[0]),
                "recall": 1.0}

    bounded = [False]
    real_run = passkey.run_strategy

    def run(model, tok, prompts, st, *a, **k):
        bounded[0] = st.bounded
        return real_run(model, tok, prompts, st, *a, **k)

    monkeypatch.setattr(passkey, "score_trial", score)
    monkeypatch.setattr(passkey, "run_strategy", run)
    monkeypatch.setattr(cli, "load_model_or_fail", lambda *a, **k: (tiny_llama(),
                                                                    CharTokenizer()))
    monkeypatch.setattr("mlx_h2o.cli.passkey.check_model_arg", lambda *a: None)
    monkeypatch.setattr(cli, "load_tokenizer_or_fail", lambda *a: CharTokenizer())
    argv = ["retrieval", "--model", "tiny", "--contexts", "400", "--tasks", "single",
            "--depths", "0.2", "0.8", "--budgets", "0.25", "--haystack", "noise",
            "--new-tokens", "2", "--strategies", "baseline", "h2o-heavy",
            "--results-dir", str(tmp_path), "--no-progress"]
    assert cli_main(argv) == 0
    rows = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["rows"]
    assert "kept" not in rows[0] and (rows[1]["kept"], rows[1]["kept_frac"]) == ("1/2", 0.5)
    if pytest.importorskip("matplotlib"):
        assert list((tmp_path / "retrieval").glob("*/retrieval_kept.png"))


def _trials(correct):
    return {"trials": [{"context": 64, "task": "single", "depth": d, "correct": c}
                       for d, c in zip((0.1, 0.5, 0.9), correct)]}


def test_answers_kept_counts_only_what_the_baseline_answered():
    full = _trials([True, False, True])
    assert retrieval.answers_kept(_trials([True, True, False]), full) == (1, 2)
    assert retrieval.answers_kept(_trials([False, True, False]), full) == (0, 2)
    assert retrieval.answers_kept(_trials([True, False, True]), full) == (2, 2)
    assert retrieval.answers_kept(_trials([True] * 3), _trials([False] * 3)) == (0, 0)
    other = {"trials": _trials([True] * 3)["trials"][:2]}
    with pytest.raises(ValueError, match="different prompts"):
        retrieval.answers_kept(other, full)


@pytest.mark.parametrize("argv, want", [
    (["--tasks", "needle"], "--tasks needle: unknown"),
    (["--strategies", "h2o-huge"], "--strategies h2o-huge"),
])
def test_cli_errors_are_one_line(capsys, tmp_path, argv, want):
    with pytest.raises(SystemExit) as e:
        cli_main(["retrieval", *argv, "--results-dir", str(tmp_path)])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("mlx-h2o retrieval: error: ") and want in err, err
