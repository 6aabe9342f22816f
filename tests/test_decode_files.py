"""How many of mlx_h2o's files one evicting decode step crosses, traced.

A decode step should be readable: the cache's contract, its slot core, the
chosen step and what it calls. The trace records every Python function of
mlx_h2o entered during one steady evicting decode token of a whole model
(all layers), for a single cache (the backend's default step: compiled on
the CPU; on a GPU the fused step in step groups, make_h2o_cache's default),
for single caches in step groups folded by the reference (the GPU's
grouped path, on any backend) and for the batch cache. docs/DESIGN.md
lists them.
"""

import sys

import mlx.core as mx
import pytest

import mlx_h2o
from mlx_h2o import H2OConfig, make_h2o_cache
from mlx_h2o.cache.decode.grouped import GroupedStep
from mlx_h2o.cache.group import make_groups
from mlx_h2o.kernels import runs_on_gpu
from tiny_models import tiny_llama

MAX_FILES = 8
# What a step group's reference fold calls (group.fold_layer: the per-layer
# policy ops); a GPU folds in kernels/group_fold.py instead.
REFERENCE_FOLD = {"cache/ops_step.py", "policy.py", "scores.py", "kernels/reference.py"}


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


@pytest.mark.parametrize("face", ["single", "grouped", "batched"])
def test_an_evicting_decode_step_crosses_few_files(face):
    model = tiny_llama()
    cache = make_h2o_cache(model, H2OConfig(max_size=16, sink_size=2, heavy_budget=6),
                           layer_budget="uniform")
    if face == "grouped":
        make_groups(cache, size=len(cache), use_kernel=False)
    if face == "batched":
        cache = [c.merge([c]) for c in cache]
    files = evicting(model, cache)
    print(mx.default_device(), face, cache[0].decode.kind if face != "batched" else "", files)
    if face == "grouped":
        # Folded by the policy ops here; on a GPU by one launch of one file
        # (kernels/group_fold.py): the step's own files leave room for it.
        assert "cache/group.py" in files and "cache/decode/grouped.py" in files, files
        own = sorted(set(files) - REFERENCE_FOLD)
        assert len(own) <= MAX_FILES - 1, own
        return
    assert 0 < len(files) <= MAX_FILES, files
    if face == "batched":  # the fused kernels on a GPU, else the compiled ops step
        assert "cache/decode/rows.py" in files, files
        assert ("kernels/h2o_step.py" if runs_on_gpu() else "cache/ops_step.py") in files, files
    elif face == "single" and cache[0].decode.find(GroupedStep) is not None:
        assert "kernels/group_fold.py" in files, files
    else:
        assert "cache/ops_step.py" in files or "cache/decode/fused.py" in files, files
