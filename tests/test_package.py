"""The package's top level: lazy public names, a fast CLI start."""

import subprocess
import sys

import pytest

import mlx_h2o


@pytest.mark.parametrize("name", mlx_h2o.__all__)
def test_every_public_name_loads(name):
    assert getattr(mlx_h2o, name) is not None


def test_unknown_name_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        mlx_h2o.nope


def test_help_imports_neither_mlx_nor_mlx_lm():
    """`mlx-h2o --help` answers without loading MLX or mlx-lm (seconds on a CPU)."""
    code = ("import runpy, sys; sys.argv = ['mlx-h2o', '--help']\n"
            "try:\n    runpy.run_module('mlx_h2o', run_name='__main__')\n"
            "except SystemExit:\n    pass\n"
            "print(sorted(m for m in ('mlx', 'mlx_lm') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=True).stdout
    assert "usage" in out and out.strip().endswith("[]")


def test_the_wheel_ships_the_evaluation_texts():
    """The corpora read from package data must be listed as package data."""
    import tomllib
    from pathlib import Path

    root = Path(__file__).parents[1]
    data = tomllib.loads((root / "pyproject.toml").read_text())
    globs = data["tool"]["setuptools"]["package-data"]["mlx_h2o.eval"]
    texts = sorted((root / "mlx_h2o" / "eval" / "texts").iterdir())
    assert {p.name for p in texts} == {"README.md", "austen.tar.xz",
                                       "python-docs-3.11.tar.xz"}
    for path in texts:
        assert any(path.relative_to(root / "mlx_h2o" / "eval").match(g) for g in globs)
