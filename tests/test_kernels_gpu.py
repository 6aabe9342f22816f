"""GPU decode kernels: source generation and dispatch (CPU), numerics (GPU only).

The numeric tests compare the kernels with a float64 numpy reference; they run
only where MLX has a GPU backend (Metal or CUDA). tools/gpu_check.py runs
the full sweep there.
"""

from dataclasses import replace

import mlx.core as mx
import numpy as np
import pytest

from mlx_h2o import kernels
from mlx_h2o.kernels import backend, build, reference, source
from mlx_h2o.kernels.backend import supported
from mlx_h2o.kernels.decode import choose_splits, layout, mask_mode
from kernel_refs import Case, check_case, make_inputs, ref64, rel_err, to_np

HAS_GPU = backend.gpu_backend() is not None
needs_gpu = pytest.mark.skipif(
    not HAS_GPU, reason="needs MLX with Metal or CUDA (mx.metal / mx.cuda unavailable)"
)


# --- kernel source generation (pure Python) ---------------------------------
@pytest.mark.parametrize("backend", ["cuda", "metal"])
def test_every_variant_assembles(backend):
    for label, header, body in build.all_sources(backend):
        assert "$" not in body and "$" not in header, label
        assert body.count("{") == body.count("}"), label


def test_cuda_and_metal_share_one_body():
    for mask in build.MASK_KINDS:
        for flags in [(False, False, False), (True, True, True), (True, False, True)]:
            _, cuda = build.pass1_source("cuda", mask, *flags)
            _, metal = build.pass1_source("metal", mask, *flags)
            assert cuda.replace(source.CUDA_IDS, "") == metal.replace(source.METAL_IDS, "")
    _, cuda = build.pass2_source("cuda", True, True)
    _, metal = build.pass2_source("metal", True, True)
    assert cuda.replace(source.CUDA_IDS, "") == metal.replace(source.METAL_IDS, "")


@pytest.mark.parametrize("mask", build.MASK_KINDS)
@pytest.mark.parametrize("split,fused", [(False, False), (True, False), (False, True), (True, True)])
def test_inputs_match_body(mask, split, fused):
    inputs, outputs = build.pass1_names(mask, True, split, fused)
    _, body = build.pass1_source("cuda", mask, True, split, fused)
    for name in inputs + outputs:
        assert name in body, name
    assert ("mask" in inputs) == (mask in ("bool", "add"))
    assert ("victim" in outputs) == (fused and not split)


@pytest.mark.parametrize("D", [64, 80, 96, 128, 256])
@pytest.mark.parametrize("itemsize", [2, 4])
@pytest.mark.parametrize("G,L", [(1, 1), (4, 1), (7, 1), (8, 8), (16, 1), (4, 3)])
@pytest.mark.parametrize("tpk", [0, 16, 8])
def test_layout(D, itemsize, G, L, tpk):
    lay = layout(D, itemsize, G, L, 0, tpk)
    # TPK lanes a key row where the row fits them (32 / TPK rows a warp read), else 32
    assert lay.TPK == (tpk if tpk and tpk * 8 >= D else 32)
    assert lay.EPL in (2, 4, 8) and D % lay.EPL == 0 and lay.TPK * lay.EPL >= D
    assert lay.tile == 4 * lay.U * (32 // lay.TPK)  # keys per block iteration
    rp = 1 << (lay.R - 1).bit_length()
    assert rp * lay.U <= lay.TPK and lay.U in (1, 2, 4, 8)  # one (row, key) per lane or fewer
    assert lay.R <= 8 and lay.R * lay.RT == G * L


def test_layout_refuses_more_logits_than_lanes():
    assert layout(64, 2, 8, 1, 2, 16).U == 2  # 8 rows x 2 keys: one logit a lane of 16
    with pytest.raises(ValueError, match="U <= 2"):
        layout(64, 2, 8, 1, 4, 16)  # 32 logits for 16 lanes


def test_choose_splits():
    assert choose_splits(1, 8, 64) == 1 and choose_splits(256, 8, 64) == 1
    counts = [choose_splits(n, 8, 64) for n in (257, 1025, 4097, 32768, 10**6)]
    assert counts == sorted(counts) and max(counts) <= 256 and counts[0] > 1
    assert choose_splits(32768, 512, 64) == 1  # enough blocks already
    # D > 128: half the blocks (register-bound residency, docs/DESIGN.md)
    assert choose_splits(32768, 8, 32, 128) == 64 and choose_splits(32768, 8, 32, 256) == 32


def test_lanes_per_key(monkeypatch):
    from mlx_h2o.kernels import decode
    from mlx_h2o.kernels.decode import lanes_per_key

    monkeypatch.setattr(decode, "device_backend", lambda: "metal")
    assert lanes_per_key(64, 32768) == 32  # the Metal twin keeps one row a warp read
    monkeypatch.setattr(decode, "device_backend", lambda: "cuda")
    assert ([lanes_per_key(64, n) for n in (1, 256, 257, 4096, 8191, 8192, 32768)]
            == [8, 8, 16, 16, 16, 8, 8])  # 8 in one pass and from 8K keys
    assert {lanes_per_key(d, n) for d in (80, 96, 128) for n in (1, 4096, 32768)} == {16}
    assert {lanes_per_key(d, 32768) for d in (72, 256)} == {32}  # not measured / no fit


def test_mask_mode():
    B, Hq, Hk, L, N = 2, 8, 2, 3, 10
    assert mask_mode(None, B, Hq, Hk, L, N) == ("none", 0)
    assert mask_mode("causal", B, Hq, Hk, L, N) == ("causal", 0)
    assert mask_mode("sliding", B, Hq, Hk, L, N) is None
    assert mask_mode(mx.ones((L, N), mx.bool_), B, Hq, Hk, L, N) == ("bool", 0)
    assert mask_mode(mx.zeros((B, Hq, L, N)), B, Hq, Hk, L, N) == ("add", 1)
    assert mask_mode(mx.zeros((1, Hk, 1, N), mx.float16), B, Hq, Hk, L, N) == ("add", 2)
    assert mask_mode(mx.zeros((B, 3, L, N)), B, Hq, Hk, L, N) is None
    assert mask_mode(mx.zeros((L, N), mx.int32), B, Hq, Hk, L, N) is None


# --- dispatch ---------------------------------------------------------------
def _qkv(L=1, N=33, D=64, dtype=mx.float32):
    q = mx.random.normal((1, 4, L, D)).astype(dtype)
    k = mx.random.normal((1, 2, N, D)).astype(dtype)
    return q, k, mx.random.normal((1, 2, N, D)).astype(dtype)


def test_dispatch_rejects_unsupported_shapes():
    q, k, v = _qkv(L=9)
    assert not supported(q, k, v)  # Lq > 8: prefill, reference path
    q, k, v = _qkv(D=72 + 2)
    assert not supported(q, k, v)
    q, k, v = _qkv()
    assert not supported(q, k.astype(mx.float16), v)


@pytest.mark.skipif(HAS_GPU, reason="checks the CPU-only fallback")
def test_dispatch_falls_back_to_reference_on_cpu():
    q, k, v = _qkv()
    got = kernels.scaled_dot_product_attention_with_scores(q, k, v, scale=0.125)
    want = reference.scaled_dot_product_attention_with_scores(q, k, v, scale=0.125)
    for a, b in zip(got, want):
        assert mx.array_equal(a, b)
    with pytest.raises(ValueError, match="no GPU kernel"):
        kernels.scaled_dot_product_attention_with_scores(q, k, v, scale=0.1, use_kernel=True)
    pos = mx.zeros((1, 2, 33), mx.int32)
    assert not kernels.h2o_step_supported(q, k, v, pos)


def test_numpy_reference_matches_mx_reference():
    q, k, v = _qkv(L=3, N=40)
    mask = mx.random.uniform(shape=(1, 2, 3, 40)) > 0.3
    got = ref64(to_np(q), to_np(k), to_np(v), 0.2, np.array(mask), None)
    # On the CPU: CUDA float32 matmuls may use TF32 (~1e-3 relative).
    with mx.stream(mx.cpu):
        want = reference.scaled_dot_product_attention_with_scores(
            q, k, v, scale=0.2, mask=mask
        )
    for a, b in zip(got, want):
        assert rel_err(a, to_np(b)) < 1e-5


# --- numerics on the GPU ----------------------------------------------------
GPU_CASES = [
    Case(N=1), Case(N=257, D=80, dtype="bfloat16"), Case(N=1025, D=256, dtype="float32"),
    Case(N=4097, Hq=32, Hk=8), Case(N=97, L=8, Hq=16, Hk=2, mask="causal"),
    Case(N=257, L=4, mask="bool_kv", sinks=True, B=2), Case(N=257, L=2, mask="add_q"),
    Case(N=257, L=4, mask="bool_row"), Case(N=1025, view="slice", B=2),
    Case(N=257, view="strided", dtype="float32"), Case(N=2000, splits=1),
    Case(N=9001, D=64, dtype="bfloat16", mask="bool_kv"), Case(N=8193, Hq=32, Hk=8, sinks=True),
    Case(N=4097, D=64, Hq=32, Hk=8, dtype="float32"), Case(N=300, D=64, L=8, Hq=16, Hk=2,
                                                            mask="causal", sinks=True),
    Case(N=9001, D=64, splits=1, sinks=True), Case(N=200, D=64, B=2, mask="add_q"),
]


@needs_gpu
@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: c.label())
@pytest.mark.parametrize("tpk", [0, 32, 16, 8])
def test_kernel_matches_float64(case, tpk):
    from mlx_h2o.kernels.decode import decode_attention, launch_settings

    def fn(q, k, v, scale, mask, sinks):
        return decode_attention(q, k, v, scale=scale, mask=mask, sinks=sinks,
                                num_splits=case.splits, poison=float("nan"))

    # tpk 0: lanes_per_key(D, N); mma 0: the shared-body kernel (tensor cores: below)
    with launch_settings(lanes_per_key=tpk, mma=0):
        ok, errs = check_case(case, 1234, fn)
    assert ok, errs


MMA_CASES = [
    Case(N=300, D=64), Case(N=1025, D=96, dtype="bfloat16"), Case(N=4097, Hq=32, Hk=8),
    Case(N=16385, D=64, Hq=32, Hk=8, dtype="bfloat16"), Case(N=32768, Hq=32, Hk=8),
    Case(N=9001, Hq=8, Hk=8, B=2), Case(N=2001, D=64, L=8, Hq=8, Hk=8, mask="causal"),
    Case(N=999, L=2, Hq=16, Hk=4, mask="causal", sinks=True), Case(N=1025, view="slice", B=2),
    Case(N=700, view="strided", D=96), Case(N=5000, Hq=8, Hk=1, dtype="bfloat16", splits=3),
    Case(N=257, D=64, Hq=6, Hk=2, sinks=True, splits=2),
]


@needs_gpu
@pytest.mark.parametrize("case", MMA_CASES, ids=lambda c: c.label())
def test_mma_pass1_matches_float64(case):
    """The tensor-core pass 1 (CUDA, float16 / bfloat16 split launches)
    against float64: out, logits and lse, outputs poisoned."""
    from mlx_h2o.kernels import decode
    from mlx_h2o.kernels.decode import decode_attention

    if backend.gpu_backend() != "cuda":
        pytest.skip("the tensor-core pass 1 is CUDA only")

    def fn(q, k, v, scale, mask, sinks):
        return decode_attention(q, k, v, scale=scale, mask=mask, sinks=sinks,
                                num_splits=case.splits, poison=float("nan"))

    with decode.launch_settings(mma=2):  # every head dim it takes, not only where faster
        q, k, _, mask, sinks = make_inputs(case, 7)
        plan = decode._plan(q, k, mask, sinks, case.splits)
        assert plan.keywords["mma"] and plan.keywords["S"] > 1  # the case takes it
        ok, errs = check_case(case, 2024, fn)
    assert ok, errs


def test_mma_supported(monkeypatch):
    from mlx_h2o.kernels import decode
    from mlx_h2o.kernels.decode import mma_supported

    monkeypatch.setattr(decode, "device_backend", lambda: "cuda")
    assert decode.settings().mma == 1  # the default: where it measured faster
    assert mma_supported(mx.float16, 64, 1, 4, "none") and mma_supported(mx.float16, 96, 1, 4, "none")
    assert not mma_supported(mx.float16, 128, 1, 4, "none")
    with decode.launch_settings(mma=2):
        assert mma_supported(mx.float16, 128, 1, 4, "none")
        assert mma_supported(mx.bfloat16, 64, 8, 1, "causal")
        assert mma_supported(mx.float16, 96, 1, 8, "none")
        assert not mma_supported(mx.float32, 128, 1, 4, "none")  # no float32 tensor-core path
        assert not any(mma_supported(mx.float16, d, 1, 4, "none") for d in (80, 256))
        assert not mma_supported(mx.float16, 128, 1, 4, "bool")  # array masks: shared body
        assert not mma_supported(mx.float16, 128, 3, 4, "none")  # 12 rows: row tiles
        with decode.launch_settings(max_rows=16):
            assert not mma_supported(mx.float16, 128, 3, 4, "none")  # one tile of 12 rows: > 8
        monkeypatch.setattr(decode, "device_backend", lambda: "metal")
        assert not mma_supported(mx.float16, 64, 1, 4, "none")  # CUDA only
    monkeypatch.setattr(decode, "device_backend", lambda: "cuda")
    with decode.launch_settings(mma=0):
        assert not mma_supported(mx.float16, 64, 1, 4, "none")
    assert mma_supported(mx.float16, 64, 1, 4, "none")  # the settings came back


def test_launch_settings_are_checked_and_restored():
    from mlx_h2o.kernels import decode

    before = decode.settings()
    # Equal settings are one signature key (a repeated call's), others are not.
    assert {decode.LaunchSettings(): 1}.get(decode.LaunchSettings(mma=1)) == 1
    assert decode.LaunchSettings(mma=0) not in {decode.LaunchSettings(): 1}
    with pytest.raises(TypeError, match="unknown launch settings.*'lanes'"):
        with decode.launch_settings(lanes=16):
            pass
    for bad in (dict(lanes_per_key=12), dict(mma=3), dict(max_rows=0), dict(target_blocks=0),
                dict(keys_per_lane_group=-1)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            with decode.launch_settings(**bad):
                pass
    with pytest.raises(TypeError, match="must be an int"):
        with decode.launch_settings(mma=True):
            pass
    with pytest.raises(RuntimeError):
        with decode.launch_settings(target_blocks=1024) as s:
            assert decode.settings() is s and s.target_blocks == 1024
            assert decode.choose_splits(1 << 20, 8, 32) == 128  # 1024 blocks / 8 units
            raise RuntimeError("left early")
    assert decode.settings() is before and decode.choose_splits(1 << 20, 8, 32) == 64


def test_merge_keeps_every_split_weight():
    from mlx_h2o.kernels import decode

    # Pass 2's lanes keep the (m, l) of splits lane + 32 i, i < SPL.
    assert "constexpr int SPL = 8;" in source.PASS2 and decode.MAX_SPLITS == 32 * 8


def test_mma_source_is_cuda_only():
    with pytest.raises(ValueError, match="CUDA only"):
        build.pass1mma_source("metal", "none")
    with pytest.raises(ValueError, match="masks"):
        build.pass1mma_source("cuda", "bool")
    header, body = build.pass1mma_source("cuda", "causal")
    assert "mma.sync" in header and source.MASK_CAUSAL in body
    # 128 registers at most (4 blocks an SM): the bounds ride on __global__.
    assert "#define __global__ __location__(global) __launch_bounds__(128, 4)" in header
    assert not any(label.startswith("pass1mma") for label, *_ in build.all_sources("metal"))


def test_repeated_replays_a_signature_seen_before():
    from mlx_h2o.kernels.decode import Repeated

    traced, made = [], []

    def launch(x):
        traced.append(x.shape)
        return (x * 2,)

    def make():
        made.append(1)
        return launch

    rep = Repeated(size=2)
    x = mx.arange(3)
    call = lambda sig, a: rep.call(sig, [a], make)[0]  # noqa: E731
    assert mx.array_equal(call("a", x), x * 2) and len(made) == 1  # plain
    assert mx.array_equal(call("a", x + 1), (x + 1) * 2) and len(made) == 2  # recorded
    assert mx.array_equal(call("a", x + 5), (x + 5) * 2) and len(made) == 2  # replayed
    assert traced == [(3,), (3,), (3,)]  # two plain calls, one mx.compile trace
    # An input shape the signature leaves out changed: traced again, not wrong.
    y = mx.arange(4)
    assert mx.array_equal(call("a", y), y * 2) and len(made) == 2
    assert mx.array_equal(call("a", y + 1), (y + 1) * 2) and len(made) == 2
    assert traced[3:] == [(4,)]
    call("b", x)  # two signatures: nothing pushed out
    call("a", x)  # "a" used last: "b" is the oldest
    assert list(rep._seen) == ["b", "a"] and rep._seen["a"] is not None
    call("c", x)  # a third signature pushes "b" out
    assert "b" not in rep._seen and rep._seen["a"] is not None
    plain = Repeated(size=0)
    for i in range(3):
        assert mx.array_equal(plain.call("a", [x + i], make)[0], (x + i) * 2)
    assert len(made) == 7 and not plain._seen  # every call of size 0 makes its launch: 4 before


class FakeKernel:
    """Stands in for a custom kernel on the CPU: checks that a launch passes
    the inputs the kernel names (in order: shapes of q, k, v, mask, sinks)
    and the grid, and returns zeros of the output shapes."""

    def __init__(self, names, calls):
        self.inputs, self.outputs = names
        self.calls = calls

    def __call__(self, *, inputs, template, grid, threadgroup, output_shapes,
                 output_dtypes, init_value=None):
        assert len(inputs) == len(self.inputs) and len(output_shapes) == len(self.outputs)
        self.calls.append((dict(zip(self.inputs, (a.shape for a in inputs))), grid))
        return [mx.zeros(s, d) for s, d in zip(output_shapes, output_dtypes)]


@pytest.mark.parametrize("mask", [None, "causal", "bool"])
@pytest.mark.parametrize("sinks", [False, True])
@pytest.mark.parametrize("splits", [1, 3])
def test_launch_passes_what_each_kernel_names(monkeypatch, mask, sinks, splits):
    """decode_attention's plumbing, plain and replayed (CPU: kernels faked)."""
    from mlx_h2o.kernels import decode

    calls = []
    monkeypatch.setattr(decode, "_make_pass1_kernel", lambda m, s, split, fused: FakeKernel(
        build.pass1_names(m, s, split, fused), calls))
    monkeypatch.setattr(decode, "_make_pass2_kernel", lambda s, fused: FakeKernel(
        build.pass2_names(s, fused), calls))
    monkeypatch.setattr(decode, "_REPEATED", decode.Repeated())
    q, k, v = _qkv(L=2, N=300, D=64)  # 4 / 2 heads: R = 4 rows a block
    m = mx.ones((1, 1, 2, 300), mx.bool_) if mask == "bool" else mask
    sk = mx.zeros((4,)) if sinks else None
    for _ in range(4):  # plain, plain and recorded, compiled (traced once), replayed
        out, logits, lse = decode.decode_attention(q, k, v, scale=0.1, mask=m, sinks=sk,
                                                   num_splits=splits)
        assert (out.shape, logits.shape, lse.shape) == ((1, 4, 2, 64), (1, 4, 2, 300), (1, 4, 2))
    assert len(calls) == 3 * (1 if splits == 1 else 2)  # the replay launches no Python
    first, grid = calls[0]
    assert first["k"] == (1, 2, 300, 64) and grid == (2 * 128, splits, 1)
    assert ("mask" in first) == (mask == "bool") and ("sinks" in first) == (sinks and splits == 1)
    if splits > 1:
        merge, grid = calls[1]
        assert ("sinks" in merge) == sinks and merge["part_o"] == (2, splits, 4, 64)
        assert grid == (2 * 4 * 128, 1, 1)  # a block per query row


@needs_gpu
@pytest.mark.parametrize("case", [Case(N=97), Case(N=4097, Hq=32, Hk=8, mask="bool_kv"),
                                  Case(N=1025, sinks=True, dtype="bfloat16")],
                         ids=lambda c: c.label())
def test_repeated_calls_replay_a_compiled_launch(case):
    from mlx_h2o.kernels import decode

    def fn(q, k, v, scale, mask, sinks):
        return decode.decode_attention(q, k, v, scale=scale, mask=mask, sinks=sinks)

    for seed in (1, 2, 3):  # plain, then compiled, then replayed on new inputs
        ok, errs = check_case(case, seed, fn)
        assert ok, (seed, errs)
    assert any(f is not None for f in decode._REPEATED._seen.values())
    # Same shapes, other strides (a cache-buffer view): read when the kernel runs.
    ok, errs = check_case(replace(case, view="slice"), 4, fn)
    assert ok, errs
    ok, errs = check_case(replace(case, view="strided"), 5, fn)
    assert ok, errs


@needs_gpu
def test_dispatch_picks_kernel_on_gpu():
    q, k, v = _qkv(dtype=mx.float16)
    assert supported(q, k, v)
    got = kernels.scaled_dot_product_attention_with_scores(q, k, v, scale=0.125)
    want = reference.scaled_dot_product_attention_with_scores(q, k, v, scale=0.125)
    assert rel_err(to_np(got[1]), to_np(want[1])) < 1e-5


def test_fold_kernel_shares_the_body_and_names_its_inputs():
    _, cuda = build.fold_source("cuda")
    _, metal = build.fold_source("metal")
    assert cuda.replace(source.CUDA_IDS, "") == metal.replace(source.METAL_IDS, "")
    inputs, outputs = build.fold_names()
    for name in inputs + outputs:
        assert name in cuda, name
