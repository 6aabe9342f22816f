"""How many of mlx_h2o's files one evicting decode step crosses, traced.

A decode step should be readable: the cache's contract, its slot core, the
chosen step and what it calls. The trace records every Python function of
mlx_h2o entered during one steady evicting decode token of a whole model
(all layers), for a single cache (the backend's default step: compiled on
the CPU, fused on a GPU) and for the batch cache. docs/DESIGN.md lists them.
"""

import sys

import mlx.core as mx
import pytest

import mlx_h2o
from mlx_h2o import H2OConfig, make_h2o_cache
from tiny_models import tiny_llama

MAX_FILES = 8


def files_crossed(step) -> list:
    """The mlx_h2o files whose Python functions ``step()`` enters."""
    files = set()

    def profile(frame, event, arg):
        if event == "call" and "/mlx_h2o/" in frame.f_code.co_filename:
            files.add(frame.f_code.co_filename.split("/mlx_h2o/")[-1])

    sys.setprofile(profile)
    try:
        step()
    finally:
        sys.setprofile(None)
    return sorted(files)


def evicting(model, cache, steps=6):
    """A cache (one sequence) past its budget, then the files of one more
    decode token."""
    with mlx_h2o.patch():
        model(mx.arange(2, 40)[None], cache=cache)
        for t in range(steps):
            mx.eval(model(mx.array([[t + 3]]), cache=cache))
        return files_crossed(lambda: mx.eval(model(mx.array([[7]]), cache=cache)))


@pytest.mark.parametrize("batched", [False, True])
def test_an_evicting_decode_step_crosses_few_files(batched):
    model = tiny_llama()
    cache = make_h2o_cache(model, H2OConfig(max_size=16, sink_size=2, heavy_budget=6),
                           layer_budget="uniform")
    if batched:
        cache = [c.merge([c]) for c in cache]
    files = evicting(model, cache)
    print(mx.default_device(), "batched" if batched else cache[0].decode.kind, files)
    assert 0 < len(files) <= MAX_FILES, files
    assert "cache/ops_step.py" in files or "cache/decode/fused.py" in files
