"""`mlx-h2o chat`: mlx_lm.chat's flags plus --h2o-*, driven through stdin on
the packaged SmolLM2; the conversation's cache stays within the budget."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from mlx_lm.chat import setup_arg_parser as mlx_lm_chat_parser

from mlx_h2o import H2OConfig, make_h2o_cache
from mlx_h2o.cli import main as cli_main
from mlx_h2o.cli.chat import Conversation, chat, setup_arg_parser

ROOT = Path(__file__).parents[1]
OPENBLAS = "/usr/lib/x86_64-linux-gnu/openblas-pthread/libopenblas.so.0"


def test_every_mlx_lm_chat_flag_and_the_h2o_flags():
    ours = {o for a in setup_arg_parser()._actions for o in a.option_strings}
    theirs = {o for a in mlx_lm_chat_parser()._actions for o in a.option_strings}
    assert theirs <= ours
    assert {"--max-kv-size", "--h2o-kv-bits", "--h2o-layer-budget", "--no-h2o",
            "--stats"} <= ours
    args = setup_arg_parser().parse_args([])
    assert args.model is None and args.stats is False  # None: the packaged default


@pytest.mark.parametrize("argv, message", [
    (["--max-kv-size", "64", "--h2o-max-size", "32"], "disagree: give --max-kv-size only"),
    (["--no-h2o", "--h2o-max-size", "64"], "with --no-h2o use --max-kv-size 64"),
    (["--max-kv-size", "0"], "--max-kv-size"),
    (["--model", "/nonexistent/model"], "no such folder"),
])
def test_user_errors_end_before_anything_loads(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        cli_main(["chat", *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


class _Group:
    def rank(self):
        return 0

    def size(self):
        return 1


@pytest.fixture(scope="module")
def smollm2():
    from mlx_h2o.models import load_model

    return load_model()


def _conversation(smollm2, argv, make_cache):
    model, tokenizer = smollm2
    args = setup_arg_parser().parse_args(argv)
    return Conversation(model, tokenizer, lambda: make_cache(model), args)


def _answer(conversation, query):
    return "".join(r.text for r in conversation.reply(query))


@pytest.mark.real_model
def test_turns_share_one_cache_bounded_by_the_budget(smollm2):
    h2o = _conversation(smollm2, ["--max-tokens", "24"], lambda m: make_h2o_cache(
        m, H2OConfig(max_size=48), layer_budget="uniform"))
    for query in ("Hello! Who are you?", "Tell me about the sea.", "And the mountains?"):
        _answer(h2o, query)
    seen = h2o.cache[0].offset
    assert seen > 3 * 24  # every turn went into the same cache
    assert all(c.size() <= 48 for c in h2o.cache)
    assert "evicted" in h2o.stats(_Group())
    h2o.reset()
    assert h2o.cache[0].offset == 0


@pytest.mark.real_model
def test_a_conversation_within_the_budget_answers_as_mlx_lm_chat(smollm2):
    """Nothing evicted: the greedy answers are mlx-lm's KVCache's, turn by turn."""
    from mlx_lm.models.cache import make_prompt_cache

    argv = ["--max-tokens", "16"]
    h2o = _conversation(smollm2, argv, lambda m: make_h2o_cache(
        m, H2OConfig(max_size=256), layer_budget="uniform"))
    plain = _conversation(smollm2, argv, make_prompt_cache)
    for query in ("Hello! Who are you?", "What is two plus two?"):
        assert _answer(h2o, query) == _answer(plain, query)
    assert h2o.cache[0].offset == plain.cache[0].offset < 256
    assert "no H2O cache" in plain.stats(_Group())


def test_the_prompt_loop_runs_commands_until_the_end_of_input(capsys):
    class Fake:
        resets = 0

        def reset(self):
            self.resets += 1

        def stats(self, group):
            return "STATS"

        def reply(self, query):
            return iter(())

    lines = iter(["h", "s", "r", "", "q", "never read"])
    fake = Fake()
    chat(fake, _Group(), stats=False, read=lambda prompt: next(lines))
    out = capsys.readouterr().out
    assert "commands: q exit" in out and "STATS" in out and fake.resets == 1
    assert out.rstrip().endswith("bye") and next(lines) == "never read"
    chat(fake, _Group(), stats=False, read=lambda prompt: None)  # end of input
    assert capsys.readouterr().out.strip() == "bye"


@pytest.mark.real_model
def test_chat_through_stdin_on_the_default_model():
    env = dict(os.environ)
    if os.path.exists(OPENBLAS):
        env["LD_PRELOAD"] = OPENBLAS
    done = subprocess.run(
        [sys.executable, "-m", "mlx_h2o", "chat", "--max-kv-size", "32",
         "--h2o-layer-budget", "uniform", "--max-tokens", "12", "--stats"],
        input="Hello! Who are you?\ns\nTell me about the sea.\nr\ns\n",
        capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert out.startswith("mlx-h2o chat: smollm2-135m, H2O, --max-kv-size 32")
    assert out.count("tokens, ") == 2  # two answers, each with its speed line
    stats = [line for line in out.splitlines() if "evicted" in line]
    assert len(stats) == 4  # after each of the two answers (--stats), s twice
    assert "reset: the conversation starts again" in out
    assert out.rstrip().endswith("bye")
