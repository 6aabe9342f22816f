"""Atomic JSON files: written to a temp file beside the target, then renamed over it.

Shared by result folders (eval/results.py) and layer profiles (profiles/), so
an interrupted write never leaves a truncated file behind. Stdlib only.
"""

import json
import os
import tempfile
from pathlib import Path


def write_json(path, obj) -> None:
    """Write JSON atomically: a temp file beside ``path``, then rename over it."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as fh:
            json.dump(obj, fh, indent=1, default=str)
            fh.write("\n")
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
