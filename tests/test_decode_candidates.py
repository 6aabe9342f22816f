"""benchmarks/decode_candidates.py's candidate caches, on a tiny random llama (CPU)."""

import importlib.util
import os
from functools import partial

import mlx.core as mx
import numpy as np

from mlx_h2o import H2OConfig, patch
from mlx_h2o.cache import H2OKVCache
from mlx_h2o.eval.ppl import decode_nll
from mlx_h2o.integration.factory import make_h2o_cache
from tiny_models import VOCAB, tiny_llama

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "benchmarks",
                      "decode_candidates.py")


def load_script():
    spec = importlib.util.spec_from_file_location("decode_candidates", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def run(model, cache_type, tokens, max_size, prefill=8, **kw):
    cache = make_h2o_cache(model, H2OConfig(max_size=max_size), cache_type, **kw)
    return decode_nll(model, tokens, cache, prefill), cache


def tokens(L=48, B=2, seed=1):
    return mx.array(np.random.default_rng(seed).integers(0, VOCAB, (B, L)), mx.int32)


def test_default_ref_is_the_package_reference_step():
    dc = load_script()
    model, x = tiny_llama(), tokens()
    ours, a = run(model, dc.CandidateCache, x, 16)
    theirs, b = run(model, H2OKVCache, x, 16, decode="reference")
    assert a[0].evicted > 0
    # Same decisions: the same tokens held in every layer and KV head.
    for ca, cb in zip(a, b):
        np.testing.assert_array_equal(np.sort(np.array(ca.positions), -1),
                                      np.sort(np.array(cb.positions), -1))
    np.testing.assert_allclose(np.array(ours), np.array(theirs), rtol=1e-5, atol=1e-5)


def test_windowed_sum_over_every_step_is_the_decode_part_of_the_accumulated_score():
    # No eviction (room for all 40 tokens) and a window longer than the
    # decode: the windowed sum is the default's score minus the prompt's.
    dc = load_script()
    model, x = tiny_llama(), tokens(L=40)
    _, acc = run(model, dc.CandidateCache, x, 64)
    _, win = run(model, partial(dc.PersistenceCache, w=64, measure="sum"), x, 64)
    prompt = make_h2o_cache(model, H2OConfig(max_size=64), dc.CandidateCache)
    with patch():
        model(x[:, :8], cache=prompt)
    for a, w, p in zip(acc, win, prompt):
        n = p.slots_used
        expected = np.array(a.score[..., : a.slots_used])
        expected[..., :n] -= np.array(p.score[..., :n])
        np.testing.assert_allclose(np.array(w.score[..., : w.slots_used]), expected,
                                   rtol=1e-4, atol=1e-5)


def test_history_starts_empty_for_a_token_written_into_a_slot():
    dc = load_script()
    cache = dc.PersistenceCache(H2OConfig(max_size=8), w=4)
    cache.hist = mx.ones((1, 1, 3, 4))
    cache.hist_pos = mx.array([[[0, 1, 2]]])
    hist = np.array(cache._history(mx.array([[[0, 5, 2, 3]]])))
    assert hist[0, 0, :, 0].tolist() == [1, 0, 1, 0]  # slot 1 rewritten, slot 3 new


def test_above_uniform_counts_keys_above_one_over_visible():
    dc = load_script()
    p = mx.array([0.5, 0.3, 0.2, 0.0])
    logits = mx.where(p > 0, mx.log(mx.maximum(p, 1e-9)), -mx.inf).reshape(1, 1, 1, 4)
    lse = mx.zeros((1, 1, 1))
    # 3 visible keys: the share is 1/3; 0.3 is below it.
    assert dc.above_uniform(logits, lse).reshape(-1).tolist() == [1, 0, 0, 0]


def test_vatp_ranks_attention_times_value_norm():
    dc = load_script()
    cache = dc.VATPCache(H2OConfig(max_size=8), ord=1)
    cache.kv.values = mx.array([[[[1.0, -1.0], [3.0, 0.0], [0.5, 0.5]]]])  # l1: 2, 3, 1
    cache.slots_used = 3
    score = mx.array([[[0.5, 0.4, 2.0]]])
    np.testing.assert_allclose(np.array(cache.rank_score(score)), [[[1.0, 1.2, 2.0]]])


def test_gumbel_softmax_is_uniform_over_visible_keys_at_a_large_temperature():
    dc = load_script()
    logits = mx.array([[[[2.0, -1.0, 0.5, -mx.inf]]]])
    p = np.array(dc.gumbel_softmax(logits, 1e6)).reshape(-1)
    np.testing.assert_allclose(p, [1 / 3, 1 / 3, 1 / 3, 0.0], atol=1e-4)
