"""The fused decode step over batch rows on a GPU (CUDA or Metal).

The same random batches as the emulated Metal check (tests/rows_step_check.py):
full rows, filling rows, rows without a token and rows that hold empty slots,
against a float64 attention reference and the batch cache's step in MLX ops.
On the CPU the source variants are checked for assembly and shared text.
"""

import pytest

from mlx_h2o.kernels import backend, build, source
import rows_step_check

needs_gpu = pytest.mark.skipif(
    backend.gpu_backend() is None,
    reason="needs MLX with Metal or CUDA (mx.metal / mx.cuda unavailable)")


@pytest.mark.parametrize("sinks", [False, True])
@pytest.mark.parametrize("split", [False, True])
def test_rows_variants_share_one_body_and_differ_from_a_sequence(sinks, split):
    _, cuda = build.pass1_source("cuda", "none", sinks, split, True, True)
    _, metal = build.pass1_source("metal", "none", sinks, split, True, True)
    assert cuda.replace(source.CUDA_IDS, "") == metal.replace(source.METAL_IDS, "")
    _, single = build.pass1_source("cuda", "none", sinks, split, True)
    assert "prm_i + (b) * 8" in cuda and "prm_i + (b) * 8" not in single
    assert ("kpos < 0 || kpos > Q" in cuda) and ("kpos < 0" not in single)
    _, merge = build.pass2_source("cuda", sinks, True, True)
    assert "prm_i + (blk_x / HK) * 8" in merge


@needs_gpu
@pytest.mark.parametrize("case", rows_step_check.CASES, ids=lambda c: c.label())
@pytest.mark.parametrize("seed", [1, 2])
def test_rows_step_matches_the_batch_step(case, seed):
    assert rows_step_check.check_rows_step(case, seed) == []
