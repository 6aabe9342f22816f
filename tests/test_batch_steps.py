"""The batch cache's speed paths against single caches and a float64 reference.

A prompt chunk whose rows fold at most ``prefill_window`` queries each is
attended by MLX's fused SDPA (per-KV-head masks) with only those queries'
logits computed; a decode step is one compiled ``ops_step.rows_step``. Each
row must keep and score exactly what a single H2OKVCache fed that row keeps
and scores, on every decode step a single cache can take.
"""

import mlx.core as mx
import numpy as np
import pytest

import mlx_h2o
from mlx_h2o import H2OConfig, make_h2o_cache
from mlx_h2o.cache import chunk
from mlx_h2o.cache.batch_cache import BatchH2OKVCache
from mlx_h2o.kernels import runs_on_gpu
from test_batch_cache import (batch_decode, batch_prefill, check_invariants, held,
                              random_prompts, rows_held, single_run)
from tiny_models import BUILDERS

# On the default device: on a GPU the batch's paths run there, and the
# single caches they are compared with take the fused kernels too.
KINDS = ["reference", "compiled"] + (["fused"] if runs_on_gpu() else [])

CONFIGS = {
    "window": H2OConfig(max_size=12, sink_size=2, heavy_budget=6, prefill_window=4,
                        prefill_pool=3),
    "ema": H2OConfig(max_size=10, sink_size=1, heavy_budget=5, score="ema",
                     prefill_window=3),
    "key_norm": H2OConfig(max_size=12, sink_size=2, heavy_budget=6, score="key_norm",
                          prefill_window=4),
    "expected": H2OConfig(max_size=12, sink_size=2, heavy_budget=6,
                          score="expected_attention", prefill_window=4),
    # One query scores an overflowing chunk: nothing to pool (policy.chunk_fold).
    "window1": H2OConfig(max_size=12, sink_size=2, heavy_budget=6, prefill_window=1,
                         prefill_pool=3),
}


def scores_by_position(cache):
    """Per layer and KV head: {position: (score, count)} of a single cache."""
    out = []
    for c in cache:
        n = c.size()
        pos, score, count = (np.array(a[0, :, :n]) for a in (c.positions, c.score, c.count))
        out.append([{int(p): (s, k) for p, s, k in zip(*row)} for row in zip(pos, score, count)])
    return out


def assert_same_scores(got, want):
    for layer_got, layer_want in zip(got, want):
        for head_got, head_want in zip(layer_got, layer_want):
            assert head_got.keys() == head_want.keys()
            for p in head_want:
                np.testing.assert_allclose(head_got[p], head_want[p], rtol=2e-4, atol=2e-5)


# The tiny Gemma's keys have near-equal norms (-4.01 to -4.10): which of two
# ties a key-norm cache keeps then rests on how a B = 4 matmul rounds its keys
# against a B = 1 one, not on the cache.
CASES = [(a, n) for a in ("llama", "gemma3_text") for n in sorted(CONFIGS)
         if (a, n) != ("gemma3_text", "key_norm")]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("arch,name", CASES)
def test_rows_keep_and_score_what_single_caches_do(arch, name, kind):
    """Rows of different fill levels (one within the budget, one a token per
    chunk, others overflowing) through windowed chunks and compiled decode."""
    config, chunk = CONFIGS[name], 9
    model = BUILDERS[arch]()
    prompts = random_prompts((2, 31, 19, 10), seed=21)
    decode = random_prompts((9,) * len(prompts), seed=22)
    batch = batch_prefill(model, config, prompts, chunk)
    batch_decode(model, batch, decode)
    check_invariants(batch)
    for b, (p, d) in enumerate(zip(prompts, decode)):
        single = single_run(model, config, p, chunk, d, kind)
        rows = [c.extract(b) for c in batch]
        assert held(rows) == held(single), f"row {b}"
        assert_same_scores(scores_by_position(rows), scores_by_position(single))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_a_batch_of_one_keeps_and_scores_what_a_single_cache_does(name, kind):
    """B = 1: a batch cache of one sequence (overflowing chunks, then decode
    steps that evict) keeps and scores what the single cache keeps."""
    config, model = CONFIGS[name], BUILDERS["llama"]()
    prompt, decode = random_prompts((29,), seed=31)[0], random_prompts((9,), seed=32)[0]
    batch = batch_prefill(model, config, [prompt], 9)
    batch_decode(model, batch, [decode])
    check_invariants(batch)
    single = single_run(model, config, prompt, 9, decode, kind)
    rows = [c.extract(0) for c in batch]
    assert held(rows) == held(single)
    assert_same_scores(scores_by_position(rows), scores_by_position(single))


def test_rows_joining_and_leaving_keep_their_tokens_while_decoding():
    """A batch that loses a row and gains one between decode steps: every
    remaining row goes on as a single cache would."""
    model, config = BUILDERS["llama"](), CONFIGS["window"]
    prompts = random_prompts((25, 6, 17), seed=23)
    decode = random_prompts((6,) * 3, seed=24)
    batch = batch_prefill(model, config, prompts, 9)
    batch_decode(model, batch, [d[:3] for d in decode])
    for c in batch:
        c.filter([0, 2])
    joining = batch_prefill(model, config, random_prompts((14,), seed=25), 9)
    for c, j in zip(batch, joining):
        c.extend(j)
    later = random_prompts((4,), seed=26)[0]
    batch_decode(model, batch, [decode[0][3:], decode[2][3:], later + later[:2]])
    check_invariants(batch)
    for b, (p, d) in enumerate([(prompts[0], decode[0]), (prompts[2], decode[2])]):
        want = single_run(model, config, p, 9, d, "auto")
        assert rows_held(batch, 3)[b] == held(want)


def test_a_row_without_a_token_keeps_the_slot_bound():
    """Left padding that reaches a decode step: the padded row gets no token
    while full; the batch stays within max_size and the row as it was."""
    model, config = BUILDERS["llama"](), CONFIGS["window"]
    prompts = random_prompts((20, 16), seed=27)
    batch = batch_prefill(model, config, prompts, 9)
    before = rows_held(batch, 2)[1]
    assert batch[0].kept == [12, 12] and batch[0].size() == 12
    for c in batch:
        c.prepare(left_padding=[0, 2])
    batch_decode_uneven(model, batch, random_prompts((2,), seed=28)[0])
    assert all(c.size() <= config.max_size for c in batch)
    assert batch[0].seen == [22, 16] and rows_held(batch, 2)[1] == before
    check_invariants(batch)


def batch_decode_uneven(model, batch, tokens):
    with mlx_h2o.patch():
        for t in tokens:
            model(mx.array([[t], [0]]), cache=batch)


# --- fused attention under per-head masks -------------------------------------------
def attention_f64(q, k, v, scale, mask):
    """Softmax attention in float64; rows that see nothing give zeros."""
    q, k, v, m = (np.array(a, np.float64) for a in (q, k, v, mask.astype(mx.float32)))
    B, Hq, L, D = q.shape
    G = Hq // k.shape[1]
    k, v, m = (np.repeat(a, G, axis=1) if a.shape[1] > 1 else a for a in (k, v, m))
    s = scale * q @ k.swapaxes(-1, -2)
    s = np.where(m > 0, s, -np.inf)
    top = np.max(s, axis=-1, keepdims=True)
    e = np.exp(s - np.where(np.isfinite(top), top, 0.0))
    w = e / np.maximum(e.sum(axis=-1, keepdims=True), 1e-300)
    return w @ v


@pytest.mark.parametrize("Hq,Hk,L,N,D", [(6, 2, 7, 13, 64), (4, 1, 5, 33, 80),
                                         (8, 8, 3, 97, 128)])
def test_fused_attention_matches_float64_with_per_head_masks(Hq, Hk, L, N, D):
    rng = np.random.default_rng(Hq * 100 + N)
    B = 3
    q = mx.array(rng.standard_normal((B, Hq, L, D)).astype(np.float32))
    k = mx.array(rng.standard_normal((B, Hk, N, D)).astype(np.float32))
    v = mx.array(rng.standard_normal((B, Hk, N, D)).astype(np.float32))
    pos = rng.permutation(N)[None, None].repeat(B, 0).repeat(Hk, 1)
    pos[rng.random((B, Hk, N)) < 0.2] = -1  # EMPTY slots, per row and head
    qpos = np.arange(N - L, N)[None].repeat(B, 0)
    qpos[1, :2] = -1  # padding queries: their outputs are finite and unused
    mask = mx.array(pos)[:, :, None, :]
    mask = (mask >= 0) & (mask <= mx.array(qpos)[:, None, :, None])
    out = chunk.fused_attention(q, k, v, D**-0.5, mask)
    want = attention_f64(q, k, v, D**-0.5, mask)
    seen = np.array(mask.any(axis=-1))  # (B, Hk, L)
    rows = np.repeat(seen, Hq // Hk, axis=1) if Hk > 1 else np.broadcast_to(seen, (B, Hq, L))
    got = np.array(out)
    assert np.isfinite(got).all()
    # float32 softmax attention over <= 97 keys: ~1e-6 relative in float64 terms
    np.testing.assert_allclose(got[rows], want[rows], rtol=1e-4, atol=1e-5)


def test_batch_class_of_single_caches_is_the_batch_cache():
    model = BUILDERS["llama"]()
    caches = make_h2o_cache(model, H2OConfig(max_size=16))
    assert isinstance(caches[0].merge([caches[0]]), BatchH2OKVCache)
