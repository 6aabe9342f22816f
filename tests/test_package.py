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


# --- the reference BLAS of the Linux mlx-cpu wheel -------------------------------------------
WHEEL_BLAS = ("7f761df79000-7f761e000000 r-xp 00000000 08:01 123 /venv/lib/python3.11/"
              "site-packages/mlx_cpu.libs/libblas-bd8a282c.so.3.10.0\n")


def test_reference_blas_is_told_from_the_maps_and_ld_preload():
    from mlx_h2o.blas import OPENBLAS, reference_blas_in_use

    assert reference_blas_in_use(WHEEL_BLAS, preload="")
    assert not reference_blas_in_use(WHEEL_BLAS, preload=OPENBLAS)
    assert not reference_blas_in_use(WHEEL_BLAS, preload="/opt/intel/lib/libmkl_rt.so")
    # macOS / CUDA wheels bundle no reference BLAS
    assert not reference_blas_in_use("7f76-7f77 r-xp 0 0 0 /usr/lib/libc.so.6\n", preload="")


WARN_ONCE = """
import sys, warnings
sys.path.insert(0, {tests!r})
warnings.simplefilter("always")
with warnings.catch_warnings(record=True) as at_import:
    import mlx_h2o
    from mlx_h2o import H2OConfig, make_h2o_cache
    from tiny_models import tiny_llama
with warnings.catch_warnings(record=True) as later:
    for _ in range(2):
        make_h2o_cache(tiny_llama(), H2OConfig(max_size=16))
from mlx_h2o.blas import reference_blas_in_use
told = [str(w.message) for w in later if w.category.__name__ == "ReferenceBLASWarning"]
print(reference_blas_in_use(), len(at_import), len(told), told[0] if told else "")
"""


def test_python_users_are_told_once_when_the_first_cache_is_made():
    """From Python (not the CLI, which re-executes itself with OpenBLAS), once a
    process, at the first cache or model load, never at import."""
    import os
    from pathlib import Path

    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    code = WARN_ONCE.format(tests=str(Path(__file__).parent))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, env=env, check=True).stdout.strip()
    slow, at_import, told, message = out.split(" ", 3)
    if slow != "True":
        pytest.skip("this MLX does not run on the Linux mlx-cpu wheel's reference BLAS")
    assert (at_import, told) == ("0", "1")
    assert "reference BLAS" in message and "LD_PRELOAD=" in message
    assert "the mlx-h2o command does this itself" in message


def test_the_wheel_ships_the_evaluation_texts():
    """The corpora read from package data must be listed as package data."""
    import tomllib
    from pathlib import Path

    root = Path(__file__).parents[1]
    data = tomllib.loads((root / "pyproject.toml").read_text())
    globs = data["tool"]["setuptools"]["package-data"]["mlx_h2o.eval"]
    texts = sorted((root / "mlx_h2o" / "eval" / "texts").iterdir())
    assert {p.name for p in texts} == {"README.md", "austen.tar.xz",
                                       "python-docs-3.11.tar.xz", "shakespeare.tar.xz"}
    for path in texts:
        assert any(path.relative_to(root / "mlx_h2o" / "eval").match(g) for g in globs)
