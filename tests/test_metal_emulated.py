"""The Metal kernels, run on the CPU by a SIMT emulator (tests/metal_emu.py).

``mx.fast.metal_kernel`` is replaced by the emulator and the backend is
reported as Metal, so the library's own launch code builds and launches the
Metal text (the Metal prelude and the body CUDA shares), and the results are
checked against the float64 reference, outputs poisoned with NaN first. What
the emulator does not model (Metal's arithmetic and memory model, speed) is
in its docstring.
"""

import os
import shutil
import sys
import warnings

import mlx.core as mx
import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tools"))

import gpu_check  # noqa: E402
import rows_step_check  # noqa: E402
import test_batch_steps  # noqa: E402
import metal_emu  # noqa: E402
import test_group_fold_gpu  # noqa: E402
import test_kv_write_gpu  # noqa: E402
import test_quantized_kernel  # noqa: E402
import test_queue_fold_gpu  # noqa: E402
from mlx_h2o import H2OConfig  # noqa: E402
from mlx_h2o.cache import group as cache_group  # noqa: E402
from mlx_h2o.cache import first_use as first_use_check  # noqa: E402
from mlx_h2o.kernels import (backend, build, decode, group_fold, h2o_step,  # noqa: E402
                             kv_write, quantized_gpu, queued)
from kernel_refs import Case, check_case  # noqa: E402
from mlx_h2o.scores import KERNEL_MODES  # noqa: E402
from decode_steps import queue_kernel_of

needs_clang = pytest.mark.skipif(not metal_emu.find_cxx(),
                                 reason="no clang++ >= 17 for the emulator")


def _clear_kernels():
    """Forget built kernels and plans (they hold the kernels they were built with)."""
    for name in dir(build):
        if name.startswith("_make_"):
            getattr(build, name).cache_clear()
    h2o_step.step_plan.cache_clear()
    group_fold.group_plan.cache_clear()
    kv_write.write_plan.cache_clear()
    kv_write._make_write_kernel.cache_clear()
    queued._make_pass_kernel.cache_clear()
    quantized_gpu._make_quantized_kernel.cache_clear()
    quantized_gpu._make_merge_kernel.cache_clear()


@pytest.fixture
def metal(monkeypatch):
    """Kernels built for Metal and run by the emulator; ``metal(layout)`` sets
    how strided inputs are handed over. The emulator's outputs are plain
    arrays (no graph), so repeated launches run again instead of replaying a
    recording (mx.compile off)."""
    layout = {"value": "contiguous"}

    def make(**kw):
        return metal_emu.EmulatedKernel(**kw, layout=layout["value"])

    monkeypatch.setattr(build.mx.fast, "metal_kernel", make)
    monkeypatch.setattr(build, "device_backend", lambda: "metal")
    monkeypatch.setattr(decode, "device_backend", lambda: "metal")
    monkeypatch.setattr(decode, "_REPEATED", decode.Repeated())  # no replays kept after
    # Kernel factories build for Metal; the library's own dispatch (the
    # reference cache of gpu_check's runs) sees no GPU and stays on the CPU
    # paths: only the kernels called here run emulated.
    monkeypatch.setattr(h2o_step, "gpu_backend", lambda: "metal")
    monkeypatch.setattr(backend, "gpu_backend", lambda: None)
    # The CPU is the device here: take the GPU paths' checks as passed.
    monkeypatch.setattr(h2o_step, "h2o_step_supported", lambda *a, **k: True)
    monkeypatch.setattr(h2o_step, "fold_step_supported", lambda *a, **k: True)
    monkeypatch.setattr(group_fold, "gpu_backend", lambda: "metal")
    monkeypatch.setattr(group_fold, "group_fold_supported", lambda *a, **k: True)
    monkeypatch.setattr(test_group_fold_gpu, "group_fold_supported", lambda *a, **k: True)
    monkeypatch.setattr(cache_group, "group_fold_supported", lambda *a, **k: True)
    monkeypatch.setattr(h2o_step, "device_backend", lambda: "metal")
    for module in (kv_write, queued, quantized_gpu):
        monkeypatch.setattr(module, "gpu_backend", lambda: "metal")
    for module in (kv_write, queued):
        monkeypatch.setattr(module, "runs_on_gpu", lambda: True)
    mx.disable_compile()
    _clear_kernels()
    yield lambda value: layout.__setitem__("value", value)
    mx.enable_compile()
    _clear_kernels()


ATTENTION_CASES = [
    Case(N=97),
    Case(N=301, mask="bool_kv", sinks=True, splits=3),
    Case(N=257, D=64, Hq=6, Hk=2, L=2, mask="causal"),
    Case(N=130, D=80, Hq=4, Hk=4, dtype="bfloat16", mask="add_q", splits=2),
    Case(N=200, D=96, Hq=16, Hk=2, mask="bool_q", splits=4),
    Case(N=64, D=256, dtype="float32", sinks=True),
    Case(N=77, B=2, mask="bool_row", splits=2),
    Case(N=150, D=64, L=8, Hq=2, Hk=1, mask="causal", sinks=True, splits=3),
    Case(N=45, D=128, Hq=8, Hk=8, L=3, mask="add_bcast", dtype="bfloat16"),
]


def attend(case: Case):
    """check_case's fn: decode_attention with the case's splits, outputs poisoned."""
    def fn(q, k, v, scale, mask, sinks):
        return decode.decode_attention(q, k, v, scale=scale, mask=mask, sinks=sinks,
                                       num_splits=case.splits, poison=float("nan"))
    return fn


@needs_clang
@pytest.mark.parametrize("case", ATTENTION_CASES, ids=lambda c: c.label())
def test_metal_attention_matches_float64(metal, case):
    ok, errs = check_case(case, 11, attend(case))
    assert ok, errs


@needs_clang
@pytest.mark.parametrize("layout", ["padded", "transposed"])
def test_metal_attention_reads_strided_buffers(metal, layout):
    """K / V (and the mask) handed over with padded rows (NaN in the padding)
    or a transposed last axis: the kernels must follow the strides."""
    metal(layout)
    case = Case(N=203, D=64, Hq=8, Hk=2, mask="bool_kv", splits=2)
    ok, errs = check_case(case, 5, attend(case))
    assert ok, errs


@needs_clang
def test_emulator_catches_divergent_shuffles(metal):
    """A shuffle that only some threads of a SIMD group reach, or threads
    waiting at barriers that cannot complete, fail the launch instead of
    returning made-up values (or hanging)."""
    from mlx_h2o.kernels import source

    body = source.METAL_IDS + """
  float x = float(tid);
  if (lane < 16) x = H2O_SHFL_XOR(x, 1);
  out[tid] = x;
"""
    kernel = metal_emu.EmulatedKernel("divergent", ["q"], ["out"], body, source.METAL_HEADER)
    with pytest.raises(RuntimeError, match="SIMD shuffle without every lane"):
        kernel(inputs=[mx.zeros((4,))], grid=(32, 1, 1), threadgroup=(32, 1, 1),
               output_shapes=[(32,)], output_dtypes=[mx.float32])
    # Lane 0 waits at the group's barrier, the others at their shuffle: neither
    # can complete.
    body = source.METAL_IDS + """
  float x = float(tid);
  if (lane == 0) {
    H2O_BARRIER();
  } else {
    x = H2O_SHFL_XOR(x, 1);
  }
  out[tid] = x;
"""
    kernel = metal_emu.EmulatedKernel("deadlock", ["q"], ["out"], body, source.METAL_HEADER)
    with pytest.raises(RuntimeError, match="barrier that cannot complete"):
        kernel(inputs=[mx.zeros((4,))], grid=(64, 1, 1), threadgroup=(64, 1, 1),
               output_shapes=[(64,)], output_dtypes=[mx.float32])


FUSED_RUNS = [  # (config, B, Hq, Hk, D, dtype, window, prefill, splits)
    (H2OConfig(max_size=40, sink_size=2, recent_budget=8, score="ema"), 1, 8, 2, 64,
     "float16", None, 30, None),
    (H2OConfig(max_size=48, sink_size=2, recent_budget=8, score="accumulated",
               pinned=((5, 9),)), 2, 8, 2, 128, "bfloat16", 30, 40, 3),
    (H2OConfig(max_size=32, sink_size=0, recent_budget=4, score="normalized"), 1, 4, 4, 80,
     "float32", None, 20, 2),
]


@needs_clang
@pytest.mark.parametrize("run", FUSED_RUNS, ids=lambda r: f"{r[0].score}-{r[5]}-S{r[8]}")
def test_metal_fused_step_follows_the_reference_cache(metal, run):
    """The fused H2O step (attention, score fold, next victim) on Metal's
    text, step by step against the reference cache (gpu_check.fused_run:
    victims equal up to near ties, positions equal, scores within 1e-4)."""
    cfg, B, Hq, Hk, D, dt, window, prefill, splits = run
    stats = gpu_check.fused_run(cfg, B=B, Hq=Hq, Hk=Hk, D=D, dtype=dt, window=window,
                                prefill=prefill, steps=24, splits=splits, seed=3)
    assert stats["fails"] == 0, stats
    assert stats["evictions"] > 10, stats  # the cache filled and evicted


@needs_clang
@pytest.mark.parametrize("splits", [None, 1])
def test_metal_masked_fused_step_follows_the_reference_cache(metal, splits):
    """A bool mask every step: on Metal the one-pass masked kernel would bind
    33 buffers (the emulator refuses it), so the step takes two passes, also
    when one is asked for, and still follows the reference cache."""
    cfg = H2OConfig(max_size=40, sink_size=2, recent_budget=8)
    stats = gpu_check.fused_run(cfg, B=2, Hq=8, Hk=2, D=64, dtype="float16", window=None,
                                prefill=30, steps=20, splits=splits, seed=5, masked=True)
    assert stats["fails"] == 0, stats
    assert stats["evictions"] > 8, stats


@needs_clang
@pytest.mark.parametrize("case", rows_step_check.CASES, ids=lambda c: c.label())
def test_metal_rows_step_matches_the_batch_step(metal, case):
    """The fused step over rows at different fill levels (full, filling,
    without a token, full with empty slots) on Metal's text: attention out
    against float64, positions, counts and next slots against the batch
    cache's step in MLX ops, scores within 1e-4."""
    assert rows_step_check.check_rows_step(case, seed=11) == []


@pytest.fixture
def batch_on_metal(metal, monkeypatch):
    """The batch cache's decode steps on the emulated Metal rows kernels;
    counts the fused steps taken."""
    from mlx_h2o.cache.decode import rows

    monkeypatch.setattr(rows, "runs_on_gpu", lambda: True)
    monkeypatch.setattr(rows, "h2o_step_supported", lambda *a, **k: True)
    taken = []
    fused = rows.RowsStep.fused

    def counted(self, *args):
        taken.append(1)
        return fused(self, *args)

    monkeypatch.setattr(rows.RowsStep, "fused", counted)
    return taken


@needs_clang
@pytest.mark.parametrize("name", ["window", "ema"])
def test_metal_batch_rows_keep_what_single_caches_do(batch_on_metal, name):
    """Rows of different fill levels, and a batch of one, decoding on the
    Metal rows kernels keep and score exactly what single caches (CPU ops)
    fed each row keep."""
    test_batch_steps.test_rows_keep_and_score_what_single_caches_do(
        "llama", name, "compiled")
    assert len(batch_on_metal) >= 9 * 2  # every decode step of both layers
    test_batch_steps.test_a_batch_of_one_keeps_and_scores_what_a_single_cache_does(
        name, "compiled")


@needs_clang
def test_metal_batch_rows_joining_leaving_and_padded(batch_on_metal):
    """Rows leaving, joining and a left-padded row without a token, on the
    Metal rows kernels: as single caches, and within the slot bound."""
    test_batch_steps.test_rows_joining_and_leaving_keep_their_tokens_while_decoding()
    test_batch_steps.test_a_row_without_a_token_keeps_the_slot_bound()
    assert len(batch_on_metal) > 0


@needs_clang
def test_metal_fold_step_matches_the_policy(metal):
    """h2o_fold_step on Metal's text against the policy in mx ops: equal
    victims, positions and counts, scores within 1e-5 (gpu_check.run_fold)."""
    assert gpu_check.run_fold(seed=4) == 0


@needs_clang
@pytest.mark.parametrize("mode", KERNEL_MODES)
@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16])
def test_metal_group_fold_matches_the_policy(metal, mode, dtype):
    """The group fold (a full cache's one launch a token) on Metal's text:
    two layers of different sizes and capacities against the per-layer
    policy ops (test_group_fold_gpu.check_group_fold, smaller shapes)."""
    test_group_fold_gpu.check_group_fold(mode, dtype, D=64, Hq=8, Hk=2, B=1, sizes=(61, 97),
                                         caps=(64, 97), offset=500)


@needs_clang
@pytest.mark.parametrize("bits,gs", [(8, 64), (4, 32)])
def test_metal_group_fold_reads_packed_keys(metal, bits, gs):
    """The group fold over packed quantized K/V, dequantized in registers."""
    test_group_fold_gpu.check_group_fold_quantized(bits, gs, mx.float16, D=64, Hq=8, Hk=2,
                                                   sizes=(64, 37))


# The GPU test files' own checks, called with the emulator in place (smaller
# cases where theirs would take minutes on one CPU).
def gpu_quantize(x, group_size=64, bits=8):
    """mx.quantize as MLX's GPU kernels compute it (the K/V write kernels
    mirror those): the group's max starts at 0 and ties round away from
    zero; MLX's CPU quantize starts at -inf and rounds ties to even, so on
    the CPU it is not the reference for these kernels. float32 numpy."""
    a = np.array(x.astype(mx.float32)).reshape(-1, group_size)
    nbins = np.float32((1 << bits) - 1)

    def round_away(v):
        return np.sign(v) * np.floor(np.abs(v) + np.float32(0.5))

    w_min, w_max = a.min(1), np.maximum(a.max(1), np.float32(0))
    scale = np.maximum((w_max - w_min) / nbins, np.float32(1e-7))
    side = np.abs(w_min) > np.abs(w_max)
    scale = np.where(side, scale, -scale)
    edge = np.where(side, w_min, w_max)
    q0 = round_away(edge / scale)
    scale = np.where(q0 == 0, scale, edge / np.where(q0 == 0, 1, q0)).astype(np.float32)
    bias = np.where(q0 == 0, 0, edge).astype(np.float32)
    codes = np.clip(round_away((a - bias[:, None]) / scale[:, None]), 0, nbins)
    per = 32 // bits
    codes = codes.astype(np.uint64).reshape(-1, per) << (np.arange(per, dtype=np.uint64) * bits)
    words = codes.sum(1).astype(np.uint32).reshape(*x.shape[:-1], -1)
    shape = (*x.shape[:-1], x.shape[-1] // group_size)
    return (mx.array(words), mx.array(scale.reshape(shape)).astype(x.dtype),
            mx.array(bias.reshape(shape)).astype(x.dtype))


@needs_clang
@pytest.mark.parametrize("dtype,D,bits,gs,dense_out", [(mx.bfloat16, 64, 4, 32, True),
                                                       (mx.float16, 128, 8, 64, False)])
def test_metal_quantized_write(metal, monkeypatch, dtype, D, bits, gs, dense_out):
    monkeypatch.setattr(mx, "quantize", gpu_quantize)
    test_kv_write_gpu.test_quantized_write_matches_mx_quantize(dtype, D, bits, gs, dense_out)


@needs_clang
def test_metal_packed_write(metal, monkeypatch):
    monkeypatch.setattr(mx, "quantize", gpu_quantize)
    test_kv_write_gpu.test_packed_write_matches_mx_quantize(mx.float16, 64, 4, 32)


def test_gpu_quantize_is_mx_quantize_away_from_ties():
    """The stand-in oracle agrees with MLX's quantize wherever no value sits
    on a rounding tie (random float32 data: none do)."""
    x = mx.array(np.random.default_rng(0).standard_normal((3, 4, 256)).astype(np.float32))
    for bits, gs in ((4, 32), (8, 64), (2, 128)):
        for got, want in zip(gpu_quantize(x, gs, bits), mx.quantize(x, group_size=gs, bits=bits)):
            np.testing.assert_array_equal(np.array(got), np.array(want))


@needs_clang
@pytest.mark.parametrize("dtype,D,Hq,Hk,n,T", [(mx.float16, 64, 8, 8, 97, 7),
                                               (mx.bfloat16, 96, 8, 2, 257, 32),
                                               (mx.float32, 128, 32, 8, 1, 1)])
def test_metal_queue_fold(metal, dtype, D, Hq, Hk, n, T):
    test_queue_fold_gpu.test_queue_fold_matches_float64(dtype, D, Hq, Hk, n, T)


@needs_clang
@pytest.mark.parametrize("tile", queued.TILES)
def test_metal_queue_fold_tiles(metal, tile):
    test_queue_fold_gpu.test_queue_fold_any_visible_counts(tile)


@needs_clang
@pytest.mark.parametrize("N,bits", [(1, (4,)), (97, (8,))])
def test_metal_quantized_attention(metal, N, bits):
    test_quantized_kernel.test_gpu_kernel_matches_reference(N, bits)


@needs_clang
def test_metal_two_segments_take_the_dequantize_path(metal, monkeypatch):
    """Two segments (a mixed cache) would bind more buffers than Metal's 31
    (the emulator refuses such a launch): on Metal they are not the kernel's,
    so the default path attends them by the reference and use_kernel=True
    says why."""
    from mlx_h2o.kernels import quantized
    from mlx_h2o.kernels.quantized import quantized_attention

    monkeypatch.setattr(quantized, "on_gpu", lambda: True)  # the GPU device's path
    q, k, v, k64, v64 = test_quantized_kernel.make(
        2, 8, 2, 1, 257, 128, (8, 4), 64, mx.float16, np.random.default_rng(), segments=2)
    res = quantized_attention(q, k, v, scale=0.088, bits=(8, 4), group_size=64)
    test_quantized_kernel.check(res, q, k64, v64, 0.088, mx.float16)
    with pytest.raises(ValueError, match="one segment on Metal"):
        quantized_attention(q, k, v, scale=0.088, bits=(8, 4), group_size=64, use_kernel=True)


@needs_clang
def test_metal_kernels_pass_their_first_use_check(metal):
    """The check a Mac runs before using the Metal kernels (kernels/selfcheck.py)
    passes on the Metal text, without a warning."""
    from mlx_h2o.kernels import selfcheck

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert selfcheck.kernels_pass(device=mx.cpu)


@needs_clang
@pytest.mark.skipif(not (shutil.which("nm") or shutil.which("llvm-nm")),
                    reason="no nm to measure threadgroup memory")
def test_emulator_enforces_metal_threadgroup_memory(metal):
    """A kernel's threadgroup arrays are measured (every emulated launch is
    checked against Metal's 32 KB); 9,000 floats do not fit."""
    from mlx_h2o.kernels import source

    def probe(n):
        body = source.METAL_IDS + f"""
  H2O_SHARED float buf[{n}];
  buf[tid] = float(tid);
  H2O_BARRIER();
  out[tid] = buf[(tid + 1) % 32];
"""
        return metal_emu.EmulatedKernel(f"probe{n}", ["q"], ["out"], body, source.METAL_HEADER)

    args = dict(inputs=[mx.zeros((4,))], grid=(32, 1, 1), threadgroup=(32, 1, 1),
                output_shapes=[(32,)], output_dtypes=[mx.float32])
    assert probe(1000)(**args)[0].tolist() == [float((t + 1) % 32) for t in range(32)]
    with pytest.raises(RuntimeError, match="36000 bytes of threadgroup memory"):
        probe(9000)(**args)


@needs_clang
def test_emulator_enforces_metal_buffer_table(metal):
    """Each input, each _shape / _strides it names (ndim > 0) and each output
    takes one of Metal's 31 buffer indices: 15 inputs with their strides and
    an output fit (31), one more input does not (33)."""
    from mlx_h2o.kernels import source

    def probe(n):
        names = [f"a{i}" for i in range(n)]
        reads = " + ".join(f"a{i}[a{i}_strides[0] * 0]" for i in range(n))
        body = source.METAL_IDS + f"\n  out[tid] = {reads};\n"
        kernel = metal_emu.EmulatedKernel(f"probe_b{n}", names, ["out"], body,
                                          source.METAL_HEADER, ensure_row_contiguous=False)
        return kernel(inputs=[mx.ones((4,))] * n, grid=(4, 1, 1), threadgroup=(4, 1, 1),
                      output_shapes=[(4,)], output_dtypes=[mx.float32])

    assert probe(15)[0].tolist() == [15.0] * 4
    with pytest.raises(RuntimeError, match="binds 33 buffers"):
        probe(16)


@needs_clang
@pytest.mark.parametrize("quant", [None, (8, 64)])
def test_metal_group_fold_in_grouped_caches(metal, quant):
    """Three H2O caches of different sizes grouped on the Metal group fold vs
    the same caches stepped per layer on the policy ops, over 70 decode
    tokens with evictions (test_group_fold_gpu's check): same kept positions,
    scores within summation order."""
    test_group_fold_gpu.test_grouped_caches_match_per_layer_on_gpu(quant)


@needs_clang
@pytest.mark.parametrize("quant,family", [((4, 32), "K/V write packed")])
def test_metal_kv_write_in_grouped_caches(first_use, monkeypatch, quant, family):
    """Grouped caches whose evicting steps write K/V through the Metal write
    kernel vs the same caches writing with put_along_axis (quantized: with
    MLX's GPU quantize formula, which the kernel mirrors): same kept
    positions and stored K/V. The write's first call, checked as on a Mac,
    passes without a warning."""
    monkeypatch.setattr(mx, "quantize", gpu_quantize)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        test_group_fold_gpu.test_fused_write_matches_scatters_on_gpu(quant)
    assert first_use[family] is True


@pytest.fixture
def first_use(metal, monkeypatch):
    """The kernels' first-use checks armed, as on a Mac (cache/first_use.py)."""
    monkeypatch.setattr(first_use_check, "device_backend", lambda: "metal")
    monkeypatch.setattr(first_use_check, "_PASSED", {})
    return first_use_check._PASSED


@needs_clang
def test_metal_group_fold_passes_its_first_use_check(first_use):
    """Grouped caches on a Mac check the Metal group fold on their first
    token: the emulated Metal text passes, without a warning."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        test_group_fold_gpu.test_grouped_caches_match_per_layer_on_gpu(None)
    # The caches fill through queued folds first: both families were checked.
    assert first_use == {"queue fold": True, "group fold dense": True}


@needs_clang
def test_a_wrong_group_fold_is_caught_at_first_use(first_use, monkeypatch):
    """A group fold whose victims are wrong fails the check: a warning, and
    the groups stay on the reference, so the caches still match per-layer
    ones token for token."""
    real = cache_group.group_fold_plan

    def wrong(*args, **kwargs):
        plan = real(*args, **kwargs)

        def run(*arrays):
            res = plan(*arrays)
            victims = [mx.where(v == 0, 1, 0).astype(v.dtype) for v in res.victims]
            return res._replace(victims=victims)

        return run

    monkeypatch.setattr(cache_group, "group_fold_plan", wrong)
    with pytest.warns(RuntimeWarning, match="group fold dense failed its first-use check"):
        test_group_fold_gpu.test_grouped_caches_match_per_layer_on_gpu(None)
    assert first_use == {"queue fold": True, "group fold dense": False}


@needs_clang
def test_metal_rows_step_passes_its_first_use_check(first_use, batch_on_metal):
    """A batch's first decode step on a Mac checks the Metal rows kernels
    against the ops step; they pass, and later steps run them unchecked."""
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="mlx-h2o: the Metal")
        test_batch_steps.test_a_row_without_a_token_keeps_the_slot_bound()
    assert first_use["fused step over rows"] is True


@needs_clang
def test_a_wrong_rows_step_is_caught_at_first_use(first_use, batch_on_metal, monkeypatch):
    """Rows kernels told that no row is full (every next slot an empty one)
    fail the check: a warning, and the batch stays on the ops step, so its
    rows still keep what single caches keep."""
    real = h2o_step.row_params
    monkeypatch.setattr(h2o_step, "row_params", lambda seen, has, full, *a: real(
        seen, has, [False] * len(full), *a))
    h2o_step.row_params_array.cache_clear()
    with pytest.warns(RuntimeWarning, match="fused step over rows failed its first-use check"):
        test_batch_steps.test_rows_keep_and_score_what_single_caches_do(
            "llama", "window", "compiled")
    h2o_step.row_params_array.cache_clear()
    assert first_use["fused step over rows"] is False


@needs_clang
def test_metal_queue_fold_passes_its_first_use_check(first_use):
    """H2O caches below their budget fold queued scores with the Metal queue
    fold; its first fold is checked against the ops fold and passes
    (test_queue_fold_gpu's cache check: 300 steps, then eviction)."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        test_queue_fold_gpu.test_cache_kernel_fold_equals_ops_fold("accumulated")
    assert first_use == {"queue fold": True}


@needs_clang
def test_a_wrong_queue_fold_is_caught_at_first_use(first_use, monkeypatch):
    """A queue fold that adds too much fails the check: a warning, the ops
    fold from then on, and the cache ends as an ops-fold cache does."""
    from mlx_h2o import H2OKVCache
    from mlx_h2o.cache.decode import deferred

    real = deferred.queue_fold
    monkeypatch.setattr(deferred, "queue_fold",
                        lambda *a, **k: tuple(x * 1.5 for x in real(*a, **k)))
    cfg = H2OConfig(max_size=64, sink_size=2, heavy_budget=20)
    caches = [H2OKVCache(cfg), H2OKVCache(cfg)]

    def stream(c):
        rng = np.random.default_rng(2)
        for L in [10] + [1] * 80:
            q, k, v = (mx.array(rng.standard_normal((1, h, L, 64)).astype(np.float32))
                       for h in (8, 2, 2))
            keys, values = c.update_and_fetch(k, v)
            c.h2o_attention(q, keys, values, scale=0.125, mask=c.make_mask(L))

    with pytest.warns(RuntimeWarning, match="queue fold failed its first-use check"):
        stream(caches[0])
    with test_queue_fold_gpu.ops_queue_fold():
        stream(caches[1])
    a, b = caches
    assert first_use == {"queue fold": False} and not queue_kernel_of(a)
    assert a.evicted == b.evicted > 0
    np.testing.assert_array_equal(np.array(a.positions), np.array(b.positions))
    np.testing.assert_allclose(np.array(a.score), np.array(b.score), rtol=1e-6)


def _drive(caches, steps=60, seed=4):
    """Decode through ungrouped H2O caches (per-layer steps) with the same
    float16 inputs, one prompt then single tokens; each cache's outputs."""
    rngs = [np.random.default_rng(seed) for _ in caches]
    outs = [[] for _ in caches]
    for L in [12] + [1] * steps:
        for c, rng, o in zip(caches, rngs, outs):
            q, k, v = (mx.array(rng.standard_normal((1, h, L, 64)).astype(np.float32))
                       .astype(mx.float16) for h in (8, 2, 2))
            keys, values = c.update_and_fetch(k, v)
            o.append(c.h2o_attention(q, keys, values, scale=0.125, mask=c.make_mask(L)))
    return outs


def _assert_checked_like_ops(kernel, ops, checks, family, wrong):
    """Drive a cache on the emulated ``family`` kernel and one on the ops: one
    first-use verdict (a warning only if the kernel is ``wrong``), and the
    same evictions, kept positions and outputs either way."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        a, b = _drive([kernel, ops])
    msgs = [str(w.message) for w in seen if issubclass(w.category, RuntimeWarning)]
    assert checks.get(family) is (not wrong)
    assert len(msgs) == int(wrong) and all(f"{family} failed" in m for m in msgs)
    assert kernel.evicted == ops.evicted > 0
    n = kernel.size()
    np.testing.assert_array_equal(np.array(kernel.positions[..., :n]),
                                  np.array(ops.positions[..., :n]))
    for x, y in zip(a, b):
        np.testing.assert_allclose(np.array(x.astype(mx.float32)),
                                   np.array(y.astype(mx.float32)), rtol=2e-2, atol=2e-2)


@needs_clang
@pytest.mark.parametrize("wrong", [False, True])
def test_metal_fused_step_first_use_check(first_use, monkeypatch, wrong):
    """A sliding-window cache decodes with the Metal fused step; its first
    call is checked against the op-by-op step and passes (no warning). A
    fused step with wrong victims is caught: a warning, and the cache ends
    exactly as an op-by-op cache does."""
    from mlx_h2o import H2OKVCache
    from mlx_h2o.cache.decode import fused as fused_module

    monkeypatch.setattr(fused_module, "runs_on_gpu", lambda: True)
    monkeypatch.setattr(fused_module, "h2o_step_supported", lambda *a, **k: True)
    if wrong:
        real = h2o_step.StepPlan.__call__

        def wrong_call(self, *a, **k):
            res = real(self, *a, **k)
            return res._replace(victim=mx.zeros_like(res.victim))  # always slot 0

        monkeypatch.setattr(h2o_step.StepPlan, "__call__", wrong_call)
    cfg = H2OConfig(max_size=32, sink_size=2, recent_budget=6, score="ema")
    fused = H2OKVCache(cfg, window_size=20, decode="fused")
    ops = H2OKVCache(cfg, window_size=20, decode="compiled")  # on the CPU device
    _assert_checked_like_ops(fused, ops, first_use, "fused step", wrong)


@needs_clang
@pytest.mark.parametrize("wrong", [False, True])
def test_metal_fold_step_first_use_check(first_use, monkeypatch, wrong):
    """An 8-bit H2O cache (per-layer steps: attention by the ops, then the
    fold-only kernel) on Metal's fold: its first call is checked against
    ops_step.fold_step and passes; a fold with wrong victims is caught, and
    the cache ends exactly as an op-path cache does."""
    from mlx_h2o.cache import QuantConfig, quantized_cache_type
    from mlx_h2o.cache.decode import fused as fused_module

    monkeypatch.setattr(fused_module, "runs_on_gpu", lambda: True)
    monkeypatch.setattr(fused_module, "fold_step_supported", lambda *a, **k: True)
    if wrong:
        real = fused_module.h2o_fold_step

        def wrong_fold(*a, **k):
            res = real(*a, **k)
            return res._replace(victim=mx.zeros_like(res.victim))  # always slot 0

        monkeypatch.setattr(fused_module, "h2o_fold_step", wrong_fold)
    cls = quantized_cache_type(QuantConfig(8, 64))
    cfg = H2OConfig(max_size=32, sink_size=2, recent_budget=6, score="ema")
    kernel, ops = cls(cfg, decode="fused"), cls(cfg, decode="compiled")
    _assert_checked_like_ops(kernel, ops, first_use, "fold-only step", wrong)


def _quantized_pair(monkeypatch, bits=4):
    """Two ungrouped ``bits``-bit H2O caches: the first folds on the GPU
    (fold-only kernel, then its victim written by the K/V write kernel), the
    second on the ops (mx.quantize and scatters)."""
    from mlx_h2o.cache import QuantConfig, quantized_cache_type
    from mlx_h2o.cache.decode import fused as fused_module

    monkeypatch.setattr(fused_module, "runs_on_gpu", lambda: True)
    monkeypatch.setattr(fused_module, "fold_step_supported", lambda *a, **k: True)
    cls = quantized_cache_type(QuantConfig(bits, 32))
    cfg = H2OConfig(max_size=32, sink_size=2, recent_budget=6, score="ema")
    kernel, ops = cls(cfg, decode="fused"), cls(cfg, decode="compiled")
    return kernel, ops


@needs_clang
@pytest.mark.parametrize("wrong", [False, True])
def test_metal_quantized_write_first_use_check(first_use, monkeypatch, wrong):
    """A 4-bit cache's evicting steps write the token with the Metal write
    kernel; its first write is checked against mx.quantize and scatters (here
    MLX's CPU quantize: ties may round apart) and passes. A write into the
    wrong slot is caught: a warning, scatters from then on, and the cache
    ends as an op-path cache does."""
    if wrong:
        real = kv_write.WritePlan.__call__

        def wrong_call(self, kn, vn, idx, *stored):
            return real(self, kn, vn, (idx + 1) % stored[0].shape[2], *stored)

        monkeypatch.setattr(kv_write.WritePlan, "__call__", wrong_call)
    kernel, ops = _quantized_pair(monkeypatch)
    _assert_checked_like_ops(kernel, ops, first_use, "K/V write quantized", wrong)
    assert first_use.get("fold-only step") is True


@needs_clang
@pytest.mark.parametrize("wrong", [False, True])
def test_metal_quantized_attention_first_use_check(first_use, monkeypatch, wrong):
    """A 4-bit cache attends with the Metal fused quantized kernel (the GPU
    device's path); its first decode call is checked against dequantized K/V
    and the reference and passes. A kernel with a wrong output is caught, and
    the cache ends as one on the reference does."""
    from mlx_h2o.kernels import quantized

    kernel, ops = _quantized_pair(monkeypatch)
    for c in (kernel, ops):  # attention then the ops fold, step by step (no CPU compile)
        c.set_decode("reference")
    monkeypatch.setattr(quantized, "on_gpu", lambda: True)
    if wrong:
        real = quantized_gpu.fused_quantized_attention

        def wrong_attention(*a, **k):
            out, logits, lse = real(*a, **k)
            return out * 1.1, logits, lse

        monkeypatch.setattr(quantized_gpu, "fused_quantized_attention", wrong_attention)

    def reference(queries, keys, values, *, scale, mask, sinks, kv=ops.kv):
        keys, values = kv.triples(keys, values)
        return quantized.quantized_attention(
            queries, keys, values, scale=scale, bits=kv.bits, group_size=kv.group_size,
            mask=mask, sinks=sinks, use_kernel=False)

    ops.kv.attention = reference
    _assert_checked_like_ops(kernel, ops, first_use, "quantized attention", wrong)


@needs_clang
@pytest.mark.parametrize("tpk", [16, 8])
@pytest.mark.parametrize("run", FUSED_RUNS, ids=lambda r: f"{r[0].score}-{r[5]}-S{r[8]}")
def test_metal_fused_step_at_fewer_lanes_a_key(metal, run, tpk):
    """The fused step reading a key row with 16 or 8 lanes (where the row
    fits), as decode_attention does on CUDA, against the reference cache."""
    cfg, B, Hq, Hk, D, dt, window, prefill, splits = run
    if decode.layout(D, getattr(mx, dt).size, Hq // Hk, 1, 0, tpk).TPK != tpk:
        pytest.skip(f"a key row of D={D} does not fit {tpk} lanes (32 read it)")
    with decode.launch_settings(lanes_per_key=tpk):
        stats = gpu_check.fused_run(cfg, B=B, Hq=Hq, Hk=Hk, D=D, dtype=dt, window=window,
                                    prefill=prefill, steps=24, splits=splits, seed=3)
    assert stats["fails"] == 0 and stats["evictions"] > 10, stats
