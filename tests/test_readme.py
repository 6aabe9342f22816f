"""Every ```python block in README.md and docs/*.md runs as written; every
`mlx-h2o ...` line of their shell blocks parses (flags and values exist).

A block preceded by `<!-- not-run: reason -->` is skipped with that reason.
"""

import contextlib
import importlib
import io
import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[1]
# README.md, docs/*.md and the README of every folder (eval/, benchmarks/eval/, ...).
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")),
        *sorted(p for p in [*ROOT.glob("*/README.md"), *ROOT.glob("*/*/README.md")]
                if not any(part.startswith(".") for part in p.relative_to(ROOT).parts))]
FENCE = re.compile(r"^```(\w*)\s*$")
NOT_RUN = re.compile(r"^<!--\s*not-run:\s*(.+?)\s*-->$")


def code_blocks(path: Path):
    """(language, first line number, text, not-run reason or None) per fenced block."""
    lines = path.read_text().splitlines()
    blocks, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        start, prev = i, next((l for l in reversed(lines[:i]) if l.strip()), "")
        i += 1
        while i < len(lines) and not lines[i].startswith("```"):
            i += 1
        skip = NOT_RUN.match(prev.strip())
        blocks.append((m.group(1), start + 1, "\n".join(lines[start + 1:i]),
                       skip.group(1) if skip else None))
        i += 1
    return blocks


def _blocks(langs):
    out = []
    for path in DOCS:
        for lang, line, text, skip in code_blocks(path):
            if lang in langs:
                marks = [pytest.mark.skip(reason=skip)] if skip else []
                out.append(pytest.param(text, id=f"{path.relative_to(ROOT)}:{line}",
                                        marks=marks))
    return out


def command_lines(text: str):
    """`mlx-h2o ...` / `python -m mlx_h2o ...` commands of a shell block, as argv
    after the program name; lines with placeholders (`...`, `|`, `<`) are left out."""
    text = text.replace("\\\n", " ")
    for line in text.splitlines():
        words = shlex.split(line, comments=True)
        if words[:1] == ["mlx-h2o"]:
            argv = words[1:]
        elif len(words) > 2 and words[1:3] == ["-m", "mlx_h2o"]:
            argv = words[3:]
        else:
            continue
        if not any(w in line.split("#")[0] for w in ("...", "|", "<")):
            yield argv


def check_command(argv):
    """Parse (and, where a command has one, validate) a command line without running it."""
    from mlx_h2o.cli import COMMANDS

    assert argv and argv[0] in COMMANDS, f"unknown command in {argv}"
    module = importlib.import_module(f"mlx_h2o.cli.{argv[0]}")
    parser = module.setup_arg_parser()
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            args = parser.parse_args(argv[1:])
        except SystemExit:
            pytest.fail(f"mlx-h2o {shlex.join(argv)}: {err.getvalue().strip()}")
        try:
            if hasattr(module, "check_args"):
                module.check_args(parser, args)
        except SystemExit:  # a file an earlier line of the block writes is fine
            if "no such file" not in err.getvalue():
                pytest.fail(f"mlx-h2o {shlex.join(argv)}: {err.getvalue().strip()}")


def test_blocks_are_found():
    langs = [lang for path in DOCS for lang, *_ in code_blocks(path)]
    assert langs.count("python") >= 2 and langs.count("sh") >= 10


def test_not_run_marker_is_honoured(tmp_path):
    md = tmp_path / "x.md"
    md.write_text("a\n\n<!-- not-run: needs CUDA -->\n```python\n1/0\n```\n```sh\nls\n```\n")
    assert [(b[0], b[3]) for b in code_blocks(md)] == [("python", "needs CUDA"),
                                                       ("sh", None)]


@pytest.mark.parametrize("text", _blocks({"sh", "bash", "shell"}))
def test_shell_block_commands_parse(text):
    for argv in command_lines(text):
        check_command(argv)


@pytest.mark.real_model
@pytest.mark.parametrize("text", _blocks({"python"}))
def test_python_block_runs(text, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # a block that writes files writes them here
    exec(compile(text, "<block>", "exec"), {"__name__": "__block__"})
    assert capsys.readouterr().out.strip(), "a block should show its result"


def test_readme_opens_with_the_make_targets_and_where_the_command_is():
    readme = ROOT / "README.md"
    first = code_blocks(readme)[0][2].splitlines()
    assert first[0].startswith("make demo") and first[1].startswith("make test")
    text = readme.read_text()
    intro = text[: text.index("\n## ")]  # what comes before the first section
    assert "VENV ?= .venv" in (ROOT / "Makefile").read_text()  # where make installs
    assert ".venv/bin/mlx-h2o" in intro and "source .venv/bin/activate" in intro


def test_readme_leads_with_use_and_ends_with_results():
    sections = re.findall(r"^## (.+)$", (ROOT / "README.md").read_text(), re.M)
    use = ["Install", "Generate", "Chat", "Serve", "Python API", "Configuration"]
    assert sections[: len(use)] == use
    assert sections.index("Results") > sections.index("Configuration")
