"""Policy options added for the evaluation targets: attention EMA, prefill window."""

import mlx.core as mx
import pytest
from tiny_models import VOCAB, tiny_llama

from mlx_h2o import H2OConfig, policy
from mlx_h2o.eval import ppl
from mlx_h2o.eval.strategies import parse_strategy
from mlx_h2o.scores import SCORE_MODES


def _attention(B=2, Hq=4, Hk=2, L=6, N=9, seed=0):
    logits = mx.random.normal((B, Hq, L, N), key=mx.random.key(seed)) * 3
    causal = mx.arange(N)[None] <= mx.arange(N - L, N)[:, None]
    logits = mx.where(causal, logits, -mx.inf)
    return logits, mx.logsumexp(logits, axis=-1)


def test_window_folds_only_the_last_queries():
    logits, lse = _attention()
    zero = mx.zeros((2, 2, 9))
    for mode in SCORE_MODES:
        got = policy.fold_scores(mode, zero, zero, logits, lse, 0.9, window=2)
        want = policy.fold_scores(mode, zero, zero, logits[:, :, -2:], lse[:, :, -2:])
        for g, w in zip(got, want):
            assert mx.allclose(g, w).item()
        same = policy.fold_scores(mode, zero, zero, logits, lse, 0.9, window=6)
        full = policy.fold_scores(mode, zero, zero, logits, lse, 0.9)
        assert all(mx.allclose(a, b).item() for a, b in zip(same, full))


def test_attention_ema_is_an_ema_of_probabilities():
    logits, lse = _attention(L=1, N=5)
    probs = mx.exp(logits - lse[..., None]).reshape(2, 2, 2, 5).mean(axis=2)
    s0, c0 = mx.zeros((2, 2, 5)), mx.zeros((2, 2, 5))
    s1, c1 = policy.fold_scores("attention_ema", s0, c0, logits, lse, 0.9)
    assert mx.allclose(s1, probs).item() and (c1 == 1).all().item()  # first sight
    s2, _ = policy.fold_scores("attention_ema", s1, c1, logits, lse, 0.9)
    assert mx.allclose(s2, probs).item()  # fixed point of the same step
    s3, _ = policy.fold_scores("attention_ema", mx.ones((2, 2, 5)), c1, logits, lse, 0.9)
    assert mx.allclose(s3, 0.9 + 0.1 * probs).item()


def test_config_validates_prefill_window():
    assert H2OConfig(max_size=64, prefill_window=8).prefill_window == 8
    with pytest.raises(ValueError):
        H2OConfig(max_size=64, prefill_window=-1)
    with pytest.raises(ValueError):
        H2OConfig(max_size=64, score="lru")


def test_new_options_keep_kvcache_equivalence_within_budget():
    model = tiny_llama()
    toks = mx.random.randint(0, VOCAB, (2, 40), key=mx.random.key(2))
    base = ppl.run_ppl(model, toks, parse_strategy("baseline"), 0, "chunked", chunk=16)
    for spec in ("h2o-heavy:score=attention_ema",
                 "h2o-heavy-norm:prefill_window=4,prefill_pool=5"):
        r = ppl.run_ppl(model, toks, parse_strategy(spec), 40, "chunked", chunk=16)
        assert r["nll_per_sample"] == pytest.approx(base["nll_per_sample"], abs=1e-5)


def test_pool_neighbours_follows_positions_not_slots():
    x = mx.array([[[0.0, 5.0, 0.0, 0.0, 1.0, 0.0]]])
    pos = mx.array([[[0, 1, 2, 3, 4, 9]]])
    got = policy.pool_neighbours(x, pos, 1)
    assert got.tolist() == [[[5.0, 5.0, 5.0, 1.0, 1.0, 0.0]]]  # slot 5 is no neighbour
    shuffled = mx.array([[[7, 1, 2, 3, 4, 9]]])  # slot 0 holds position 7
    got = policy.pool_neighbours(x, shuffled, 2)
    assert got.tolist() == [[[0.0, 5.0, 5.0, 5.0, 1.0, 0.0]]]


def test_pool_applies_to_chunks_only():
    logits, lse = _attention(L=6, N=9)
    pos = mx.broadcast_to(mx.arange(9), (2, 2, 9))
    zero = mx.zeros((2, 2, 9))
    plain = policy.fold_scores("accumulated", zero, zero, logits, lse)[0]
    pooled = policy.fold_scores("accumulated", zero, zero, logits, lse, 0.9, 0, pos, 3)[0]
    assert mx.allclose(pooled, policy.pool_neighbours(plain, pos, 1)).item()
    one = policy.fold_scores("accumulated", zero, zero, logits[:, :, -1:],
                             lse[:, :, -1:], 0.9, 0, pos, 3)[0]
    ref = policy.fold_scores("accumulated", zero, zero, logits[:, :, -1:], lse[:, :, -1:])[0]
    assert mx.allclose(one, ref).item()


def test_prefill_options_only_touch_chunks_that_overflow():
    """Within the budget, prefill_window/pool leave the scores as plain H2O's."""
    from mlx_h2o import make_h2o_cache, patch

    model = tiny_llama()
    toks = mx.random.randint(0, VOCAB, (1, 24), key=mx.random.key(4))
    scores = []
    for extra in ({}, {"prefill_window": 4, "prefill_pool": 5}):
        cache = make_h2o_cache(model, H2OConfig(max_size=32, score="accumulated", **extra))
        with patch():
            model(toks, cache=cache)
        scores.append(cache[0].score[..., :24])
    assert mx.array_equal(scores[0], scores[1]).item()
