"""The cache's fused-decode-step wiring, checked on CPU.

The GPU kernel (kernels.h2o_decode_step) is checked against the policy on the
GPU by tools/gpu_check.py; here an emulation of its contract in mx ops
stands in for it, so the cache's bookkeeping around the fused step (victim
carried to the next step, appended vs overwritten slots, compaction, trim)
must give exactly what the op-by-op path gives.
"""

import mlx.core as mx
import numpy as np
import pytest

import mlx_h2o.cache.decode as decode_module
import mlx_h2o.cache.decode.fused as fused_module
from mlx_h2o import H2OConfig, H2OKVCache, policy
from mlx_h2o.cache.storage import put_slot
from mlx_h2o.kernels import H2OFold, H2OStep
from mlx_h2o.kernels.reference import scaled_dot_product_attention_with_scores
from mlx_h2o.scores import KERNEL_MODES, SCORE_MODES

D, HQ, HK = 8, 4, 2


def token_slot(slot, append_slot, B, Hk):
    """(B, Hk, 1) slot of the new token, from a victim of any accepted shape."""
    assert slot is None or slot.dtype == mx.int32  # the kernels read int32
    if slot is None:
        return mx.full((B, Hk, 1), append_slot, mx.int32)
    return slot.reshape(B, Hk, -1)[..., :1]


def emulated_fold(logits, lse, positions, score, count, *, slot, append_slot, offset, mode,
                  alpha, sink_size, recent_budget, pinned, window_size):
    """kernels.h2o_fold_step's contract in plain mx ops."""
    B, Hk, N = positions.shape[0], positions.shape[1], logits.shape[-1]
    s = token_slot(slot, append_slot, B, Hk)
    positions = put_slot(positions, s, mx.full(s.shape, offset - 1, mx.int32))
    score = put_slot(score, s, mx.zeros(s.shape, mx.float32))
    count = put_slot(count, s, mx.zeros(s.shape, mx.float32))
    pos = positions[..., :N]
    sc, cn = policy.fold_scores(mode, score[..., :N], count[..., :N], logits, lse, alpha)
    score[..., :N], count[..., :N] = sc, cn
    keep = policy.protected(pos, offset + 1, sink_size, recent_budget, pinned)
    pri = policy.priority(policy.eviction_score(mode, sc, cn), keep, pos, offset + 1, window_size)
    victim = policy.select_victim(pri, pos).astype(mx.int32)[..., None, None]
    return H2OFold(positions, score, count, victim)


def emulated_step(q, k, v, positions, score, count, *, slot, append_slot, offset,
                  scale, mode, alpha, sink_size, recent_budget, pinned, window_size,
                  mask, sinks):
    """h2o_decode_step's contract (kernels/h2o_step.py) in plain mx ops: the
    attention, then the fold's contract."""
    B, Hk, N = k.shape[0], k.shape[1], k.shape[2]
    s = token_slot(slot, append_slot, B, Hk)
    pos = put_slot(positions, s, mx.full(s.shape, offset - 1, mx.int32))[..., :N]
    win = None if window_size is None else (pos > offset - 1 - window_size)[:, :, None]
    out, logits, lse = scaled_dot_product_attention_with_scores(
        q, k, v, scale=scale, mask=win, sinks=sinks
    )
    fold = emulated_fold(logits, lse, positions, score, count, slot=slot,
                         append_slot=append_slot, offset=offset, mode=mode, alpha=alpha,
                         sink_size=sink_size, recent_budget=recent_budget, pinned=pinned,
                         window_size=window_size)
    victim = mx.broadcast_to(fold.victim, (B, Hk, 1, k.shape[3]))
    return H2OStep(out, fold.positions, fold.score, fold.count, victim, logits, lse)


CALLS = []


def emulated_plan(queries, keys, positions, mask, sinks, *, mode, alpha, scale, sink_size,
                  recent_budget, pinned, window_size):
    """kernels.make_plan's contract: a StepPlan-like callable."""
    def step(q, k, v, positions, score, count, slot, append_slot, offset, mask=None, sinks=None,
             valid=None):
        CALLS.append(1)
        n = k.shape[2] if valid is None else valid
        k, v = k[..., :n, :], v[..., :n, :]  # the kernel attends the first `valid` slots
        return emulated_step(q, k, v, positions, score, count, slot=slot,
                             append_slot=append_slot, offset=offset, scale=scale, mode=mode,
                             alpha=alpha, sink_size=sink_size, recent_budget=recent_budget,
                             pinned=pinned, window_size=window_size, mask=mask, sinks=sinks)
    return step


# The emulations stand in for the GPU kernels: on a GPU machine the real fold
# kernel would otherwise serve the op-by-op reference (12 cases differed there
# in float rounding and ties), so every case runs on the CPU device.
pytestmark = pytest.mark.usefixtures("on_cpu")


@pytest.fixture
def emulated_kernel(monkeypatch):
    monkeypatch.setattr(decode_module, "runs_on_gpu", lambda: True)  # auto: fused
    monkeypatch.setattr(fused_module, "runs_on_gpu", lambda: True)
    monkeypatch.setattr(fused_module, "h2o_step_supported", lambda *a, **k: True)
    monkeypatch.setattr(fused_module, "make_plan", emulated_plan)


def drive(cache, lengths, seed, trim_at=None, dim=D):
    rng, outs = np.random.default_rng(seed), []
    for i, L in enumerate(lengths):
        if i == trim_at:
            cache.trim(3)
        q, k, v = (mx.array(rng.standard_normal((2, h, L, dim)).astype(np.float32))
                   for h in (HQ, HK, HK))
        mask = cache.make_mask(L)
        keys, values = cache.update_and_fetch(k * 3, v)
        outs.append(cache.h2o_attention(q, keys, values, scale=1.0, mask=mask))
    return outs


@pytest.mark.parametrize("mode", SCORE_MODES)
@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("trim_at", [None, 30])
def test_fused_path_matches_op_by_op_path(emulated_kernel, mode, window, trim_at):
    cfg = H2OConfig(max_size=12, sink_size=2, heavy_budget=5, score=mode, pinned=((3, 4),))
    # Fill by appends, overflow with a chunk (compaction), decode, another chunk, decode.
    lengths = [5] + [1] * 10 + [9] + [1] * 15 + [6] + [1] * 20
    fused, plain = H2OKVCache(cfg, window), H2OKVCache(cfg, window)
    # per-step op-by-op reference
    plain.set_decode("reference", defer=0)
    # Logits reach ~20 (keys x 3, scale 1): float32 exponents carry a relative
    # error of ~20 * 2**-23 = 2.4e-6 into the weights, whatever the sum order
    # (OpenBLAS's GEMM and the op-by-op path round differently).
    for a, b in zip(drive(fused, lengths, 0, trim_at), drive(plain, lengths, 0, trim_at)):
        np.testing.assert_allclose(np.array(a), np.array(b), rtol=1e-5, atol=1e-6)
    assert (fused.offset, fused.evicted, fused.size()) == (plain.offset, plain.evicted, plain.size())
    for x, y in zip(fused.state, plain.state):
        np.testing.assert_allclose(np.array(x), np.array(y), atol=1e-6)


def test_fused_path_is_taken(emulated_kernel):
    CALLS.clear()
    cache = H2OKVCache(H2OConfig(max_size=8))
    cache.set_decode(defer=0)
    drive(cache, [4, 1, 1, 1, 1, 1, 1], 1)
    assert len(CALLS) == 6  # every decode step, none for the chunk


def test_deferred_steps_skip_the_fused_launch(emulated_kernel):
    CALLS.clear()
    cache = H2OKVCache(H2OConfig(max_size=8))
    drive(cache, [4, 1, 1, 1, 1, 1, 1], 1)
    # Slots 5..8 fill without eviction (SDPA, scores queued); the fifth decode
    # step evicts (op-by-op victim), the sixth runs on the victim the fused step picked.
    assert len(CALLS) == 2


@pytest.mark.parametrize("window", [None, 7])
def test_deferred_metadata_on_the_op_by_op_path(emulated_kernel, monkeypatch, window):
    """A GPU cache defers a decode token's position/scores to the fused step; when a
    step takes the op-by-op path instead, it must write them itself."""
    monkeypatch.setattr(fused_module, "h2o_step_supported", lambda *a, **k: False)
    cfg = H2OConfig(max_size=12, sink_size=2, heavy_budget=5, score="accumulated")
    lengths = [5] + [1] * 10 + [9] + [1] * 15
    deferred, plain = H2OKVCache(cfg, window), H2OKVCache(cfg, window)
    plain.set_decode("compiled")
    for a, b in zip(drive(deferred, lengths, 3), drive(plain, lengths, 3)):
        np.testing.assert_allclose(np.array(a), np.array(b), atol=1e-6)
    for x, y in zip(deferred.state, plain.state):
        np.testing.assert_array_equal(np.array(x), np.array(y))


@pytest.fixture
def emulated_fold_kernel(monkeypatch):
    # A GPU as the cache sees it: decode metadata is deferred to the kernels.
    monkeypatch.setattr(decode_module, "runs_on_gpu", lambda: True)  # auto: fused
    monkeypatch.setattr(fused_module, "runs_on_gpu", lambda: True)
    monkeypatch.setattr(fused_module, "fold_step_supported", lambda *a, **k: True)
    monkeypatch.setattr(fused_module, "h2o_fold_step", emulated_fold)


@pytest.mark.parametrize("mode", KERNEL_MODES)
@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("kind", ["dense", "q8"])
def test_fold_step_path_matches_op_by_op_path(emulated_fold_kernel, mode, window, kind):
    """Decode steps on the op-by-op attention fold and pick the victim in one
    launch on a GPU; the cache's bookkeeping around it must match the policy."""
    from mlx_h2o.cache import QuantConfig, QuantizedH2OKVCache

    cfg = H2OConfig(max_size=12, sink_size=2, heavy_budget=5, score=mode, pinned=((3, 4),))
    make = ((lambda: H2OKVCache(cfg, window)) if kind == "dense"
            else (lambda: QuantizedH2OKVCache(cfg, window, quant=QuantConfig(8, 32))))
    dim = D if kind == "dense" else 64
    folded, plain = make(), make()
    plain.set_decode("compiled")
    lengths = [5] + [1] * 10 + [9] + [1] * 15 + [6] + [1] * 20
    for a, b in zip(drive(folded, lengths, 5, 30, dim), drive(plain, lengths, 5, 30, dim)):
        np.testing.assert_allclose(np.array(a), np.array(b), atol=1e-6)
    assert (folded.offset, folded.evicted) == (plain.offset, plain.evicted)
    assert folded.next_victim is not None  # the last steps carried the fold's victim
    for x, y in zip(folded.state, plain.state):
        np.testing.assert_allclose(np.array(x), np.array(y), atol=1e-6)


def test_masked_fused_step_after_deferred_steps(emulated_kernel):
    """Decode steps below the budget queue their scores; a step with an array
    mask or sinks takes the fused path, which must see them folded first."""
    cfg = H2OConfig(max_size=16, sink_size=2, heavy_budget=5)
    fused, plain = H2OKVCache(cfg), H2OKVCache(cfg)
    plain.set_decode("reference", defer=0)
    rngs = [np.random.default_rng(8), np.random.default_rng(8)]
    for i, L in enumerate([4] + [1] * 24):
        for cache, rng in zip((fused, plain), rngs):
            q, k, v = (mx.array(rng.standard_normal((2, h, L, D)).astype(np.float32))
                       for h in (HQ, HK, HK))
            mask, sinks = cache.make_mask(L), None
            if i == 5:  # an all-True array mask: same result as none
                mask = mx.ones((1, 1, 1, cache.size() + 1), mx.bool_)
            if i in (7, 12):  # sinks: not deferred; the second reuses the plan and fills
                sinks = mx.full((HQ,), -1.0)
            keys, values = cache.update_and_fetch(k, v)
            out = cache.h2o_attention(q, keys, values, scale=1.0, mask=mask, sinks=sinks)
            cache.last = np.array(out)
        np.testing.assert_allclose(fused.last, plain.last, rtol=1e-5, atol=1e-5)
    assert fused.evicted == plain.evicted > 0
    for x, y in zip(fused.state, plain.state):
        np.testing.assert_allclose(np.array(x), np.array(y), rtol=1e-5, atol=1e-6)
