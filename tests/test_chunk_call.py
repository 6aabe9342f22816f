"""A prompt chunk's call (cache/chunk.py): where every row folds the chunk's
last queries the call slices them; per-row selections of the same queries
must give the same attention and the same folded scores."""

import mlx.core as mx
import numpy as np
import pytest

from mlx_h2o import H2OConfig, policy
from mlx_h2o.cache import chunk
from mlx_h2o.cache.storage import DenseKV

B, Hq, Hk, D = 3, 4, 2, 16


def _inputs(rng, L, N):
    q = mx.array(rng.standard_normal((B, Hq, L, D)).astype(np.float32))
    k = mx.array(rng.standard_normal((B, Hk, N, D)).astype(np.float32))
    v = mx.array(rng.standard_normal((B, Hk, N, D)).astype(np.float32))
    pos = np.tile(np.arange(N, dtype=np.int32), (B, Hk, 1))
    for b in range(B):  # rows that evicted different tokens per KV head
        for h in range(Hk):
            pos[b, h, : N - L] = np.sort(rng.choice(3 * N, N - L, replace=False))
            pos[b, h, N - L :] = 3 * N + np.arange(L)
    return q, k, v, mx.array(pos)


def _as_rows(call, spans):
    """The same call with per-row selections (the path rows that differ take)."""
    B_ = len(spans)
    if call.window:
        columns = chunk.window_columns(call.window, spans)
        select = np.zeros((B_, call.window), bool)
        select[:, call.window - call.last :] = True
        return call._replace(last=0, select=mx.array(select), columns=mx.array(columns))
    full = chunk.full_select(call)
    full = np.ones((B_, call.length), bool) if full is None else np.array(
        mx.broadcast_to(full, (B_, call.length)))
    return call._replace(last=0, select=mx.array(full))


@pytest.mark.parametrize("score", ["accumulated", "ema", "tova",
                                   "expected_attention"])
@pytest.mark.parametrize("over", [False, True])
def test_sliced_and_selected_rows_fold_alike(score, over):
    rng = np.random.default_rng(7)
    L, N = 9, 21
    cfg = H2OConfig(max_size=16 if over else 64, sink_size=1, prefill_window=4,
                    prefill_pool=3, score=score)
    spans = [(0, L)] * B
    kept = [N] * B
    qpos = mx.array(np.tile(np.arange(3 * N, 3 * N + L, dtype=np.int32), (B, 1)))
    call = chunk.chunk_call(cfg, spans, kept, L, None, qpos)
    assert call.select is None and call.last == (4 if over else 0)
    rows = _as_rows(call, spans)
    q, k, v, pos = _inputs(rng, L, N)
    mask = policy.position_mask(pos, qpos)
    score0 = mx.array(rng.random((B, Hk, N)).astype(np.float32))
    count0 = mx.array(rng.integers(1, 5, (B, Hk, N)).astype(np.float32))
    got = []
    for c in (call, rows):
        by_window = chunk.windowed(c, mask, None)
        out, exact, expected = chunk.attention(DenseKV(), score, Hk, q, k, v, D**-0.5, mask,
                                               None, c, by_window)
        s, n = chunk.fold(cfg, c, score0, count0, pos, exact, expected)
        got.append((out, s, n))
    for a, b in zip(*got):
        np.testing.assert_allclose(np.array(a), np.array(b), rtol=2e-5, atol=2e-6)


def test_rows_that_end_before_the_chunk_take_selections():
    cfg = H2OConfig(max_size=8, prefill_window=4)
    spans = [(0, 9), (2, 7), (9, 0)]  # the last row has no token in this chunk
    call = chunk.chunk_call(cfg, spans, [20, 20, 5], 9)
    assert call.select is not None and call.last == 0
    sel = np.array(chunk.full_select(call))
    assert sel.sum(axis=1).tolist() == [4, 4, 0]  # overflowing rows: their last W
    assert sel[1, -4:].all() and not sel[2].any()
