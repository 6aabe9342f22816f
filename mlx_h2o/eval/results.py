"""Results directories: named from the run's config, config saved beside, resumable.

Layout: ``<root>/<command>/<name>-<hash>/`` holds ``config.json`` (every
setting that changes the numbers; written with the first result, so a run that
fails before one leaves no folder) and one JSON file per finished unit of work
(``<strategy>-kv<max_kv>-L<seq_len>.json``). A unit whose file exists is
skipped on the next run with the same config. Every write is atomic (a temp
file in the same folder, then ``os.replace``), so an interrupted run never
leaves a truncated result behind.
"""

import hashlib
import json
import os
import platform
import re
from pathlib import Path
from typing import Any

from ..jsonfile import write_json

DEFAULT_ROOT = "results"


def config_hash(config: dict[str, Any]) -> str:
    blob = json.dumps(config, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:8]


def slug(text: Any) -> str:
    return re.sub(r"[^A-Za-z0-9._=-]+", "_", str(text)).strip("_")


class ResultsDir:
    """A folder of results for one config; ``name_keys`` pick the readable name."""

    def __init__(self, root: str, command: str, config: dict[str, Any], name_keys=()):
        self.config = dict(config)
        parts = [slug(Path(str(config[k])).name) for k in name_keys if k in config]
        name = "-".join(parts + [config_hash(self.config)])
        self.path = Path(root) / command / name

    def _create(self) -> None:
        # On the first result, not before: a run that fails first leaves nothing.
        self.path.mkdir(parents=True, exist_ok=True)
        config_file = self.path / "config.json"
        if not config_file.exists():
            write_json(config_file, self.config)

    def file(self, key: str) -> Path:
        return self.path / f"{slug(key)}.json"

    def done(self, key: str) -> bool:
        return self.file(key).exists()

    def load(self, key: str) -> dict[str, Any] | None:
        f = self.file(key)
        return json.loads(f.read_text()) if f.exists() else None

    def save(self, key: str, result: dict[str, Any]) -> Path:
        self._create()
        f = self.file(key)
        write_json(f, result)
        return f


def machine_info() -> dict[str, Any]:
    """Machine and library versions, recorded with every result."""
    import mlx.core as mx
    import mlx_lm

    from .. import __version__
    from ..blas import openblas_active

    info = {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "mlx": mx.__version__,
        "mlx_lm": mlx_lm.__version__,
        "mlx_h2o": __version__,
        "device": str(mx.default_device()),
        "openblas": openblas_active(),
    }
    if mx.metal.is_available():
        info["gpu"] = mx.metal.device_info().get("device_name", "metal")
    elif mx.cuda.is_available():
        info["gpu"] = "cuda"
    return info
