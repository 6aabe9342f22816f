"""The group fold launched other ways, for A/Bs in one decode run.

``mlx_fold``: MLX's build of the kernel launched directly (as before session
18) instead of our cubin on the native tape. ``victim_outputs``: the same
kernel with a victim output a layer (as before session 23) instead of views
of the stacked victim. Each returns H2O caches whose step groups fold with
the variant (scripts/gpu_split.py, scripts/gpu_cache_check.py strategies).
"""

import copy
import functools
import string

import mlx.core as mx

from mlx_h2o import make_h2o_cache, native
from mlx_h2o.kernels import cubin, group_fold as group_fold_mod
from mlx_h2o.kernels.build import group_names, group_source
from mlx_h2o.kernels.decode import NT


def mlx_fold(cfg, model):
    """H2O whose group fold is MLX's build launched directly (as before
    session 18) instead of our cubin under mx.compile, for an A/B in one run."""
    cache = make_h2o_cache(model, cfg)
    for group in {id(c._group): c._group for c in cache if c._group is not None}.values():
        group._fold_kernel = functools.partial(_with_plan, _mlx_plan, group._fold_kernel)
    return cache


GROUP_PLAN = group_fold_mod.group_plan  # the library's (our cubin where it builds)


def _with_plan(make_plan, fold_kernel, *args):
    """``fold_kernel(*args)`` with group plans made by ``make_plan``."""
    group_fold_mod.group_plan = make_plan
    try:
        return fold_kernel(*args)
    finally:
        group_fold_mod.group_plan = GROUP_PLAN


@functools.lru_cache(maxsize=None)
def _mlx_plan(*args):
    return mlx_built(GROUP_PLAN(*args))


def mlx_built(plan):
    """A copy of a group plan that launches MLX's build of its kernel, directly."""
    plan = copy.copy(plan)
    plan.kernel = getattr(plan.kernel, "fallback", plan.kernel)
    plan._run = plan._launch
    return plan


def victim_outputs(cfg, model):
    """H2O whose group fold hands each layer its victim as an output of its
    own (before session 23) instead of a slice of the stacked victim: the
    same kernel plus its per-layer writes, built once per machine as the
    library's, for an A/B of the fold's host cost in one run."""
    cache = make_h2o_cache(model, cfg)
    for group in {id(c._group): c._group for c in cache if c._group is not None}.values():
        group._fold_kernel = functools.partial(_with_plan, outputs_plan, group._fold_kernel)
    return cache


# The per-layer victim writes the group fold's body ended with before session 23.
VICTIM_OUTPUTS = r"""
  {
    const i64 vb = ((i64)bq * HK + blk_x % HK) * VD;
    for (int i = tid; i < VD; i += NT) {
      switch (layer) {
$VSELECT
      }
    }
  }
"""


@functools.lru_cache(maxsize=None)
def outputs_plan(*args):
    plan = copy.copy(GROUP_PLAN(*args))
    n, B, Hq, Hk, M, VD = plan.n, plan.B, plan.Hq, plan.Hk, plan.M, plan.VD
    quantized, i32, f32 = VD == 1, mx.int32, mx.float32
    inputs, outputs = group_names(n, quantized)
    header, body = group_source("cuda", n, quantized)
    vsel = "\n".join(f"        case {i}: v{i}[vb + i] = victim_s; break;" for i in range(n))
    body += string.Template(VICTIM_OUTPUTS).substitute(VSELECT=vsel)
    name = f"h2o_group_vo{'q' if quantized else ''}{n}"
    outputs = outputs + [f"v{i}" for i in range(n)]
    fallback = mx.fast.cuda_kernel(name=name, input_names=inputs, output_names=outputs,
                                   source=body, header=header, ensure_row_contiguous=True)
    kernel = cubin.PrecompiledKernel(name, inputs, outputs, header, body, fallback)
    def launch(*arrays):  # GroupPlan._launch before session 23 (its victim VD wide)
        return kernel(
            inputs=[*arrays, plan.pins], template=plan.template,
            grid=(n * B * Hk * NT, 1, 1), threadgroup=(NT, 1, 1),
            output_shapes=[(n * B, Hk, M)] * 3 + [(n * B, Hk, 1, VD), (n * B, Hq, M), (n, 8)]
            + [(B, Hk, 1, VD)] * n,
            output_dtypes=[i32, f32, f32, i32, f32, i32] + [i32] * n)
    plan._run = native.Replay(launch)
    return plan
