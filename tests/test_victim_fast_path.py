"""The evicting steady state's fast path (H2OKVCache._write_decode_victim).

A full cache whose fused step, compiled CPU step or group fold picked the
next victim writes its decode token there without the general path's checks.
Run with it and with it forced off, every cache must end bit for bit the
same (K/V, metadata, counters, outputs), through the transitions around it: a
prompt chunk after eviction, a trim, a masked step, a group that folds at the
next token (its first member flushes, which the fast path must leave to the
general path) and a released group.
"""

import mlx.core as mx
import numpy as np
import pytest

from mlx_h2o import H2OKVCache
from mlx_h2o.cache import QuantConfig, quantized_cache_type
from mlx_h2o.cache.group import make_groups
from test_step_group import B, D, HK, configs, layer_sets, token

# Decode, a chunk of 4 past the budget, decode, a trim, decode, a masked step, decode.
SCRIPT = [5] + [1] * 45 + [4] + [1] * 20 + ["trim"] + [1] * 10 + ["mask"] + [1] * 15


def per_layer(cfgs):
    return [H2OKVCache(c) for c in cfgs]


def grouped(cfgs, last_push=True):
    return layer_sets(cfgs, last_push)[1]


def quantized(cfgs, group=False):
    qt = quantized_cache_type(QuantConfig(8, 32))
    caches = [qt(c) for c in cfgs]
    if group:
        make_groups(caches, size=len(caches), use_kernel=False)
    return caches


# name -> (caches for configs, head dim)
KINDS = {
    "per_layer": (per_layer, D),
    "grouped": (grouped, D),
    "grouped_fold_next": (lambda cfgs: grouped(cfgs, last_push=False), D),
    "quantized": (quantized, 64),
    "quantized_grouped": (lambda cfgs: quantized(cfgs, group=True), 64),
}


def play(caches, seed, d):
    rng = np.random.default_rng(seed)
    outs = []
    for step in SCRIPT:
        if step == "trim":
            for c in caches:
                c.trim(2)
        elif step == "mask":
            for c in caches:  # full caches: the token takes a slot, size stays
                mask = mx.array(rng.standard_normal((1, 1, 1, c.size())) > -1.0)
                outs += token([c], 1, rng, mask=mask, d=d)
        else:
            outs += token(caches, step, rng, d=d)
    return outs


def snapshot(c):
    n = c.size()
    arrays = (*c.kv.state(n), c.positions[..., :n], c.score[..., :n], c.count[..., :n])
    return [np.array(a) for a in arrays], (c.offset, c.evicted, c.token_bytes, n)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_fast_path_changes_nothing(kind, monkeypatch):
    make, d = KINDS[kind]
    taken = []
    fast = H2OKVCache._write_decode_victim

    def counted(self, keys, values):
        taken.append(self)
        return fast(self, keys, values)

    monkeypatch.setattr(H2OKVCache, "_write_decode_victim", counted)
    with_fast = make(configs())
    a = play(with_fast, 3, d)
    assert len(taken) > 100  # the steady state really took it

    monkeypatch.setattr(H2OKVCache, "_into_victim", lambda self, keys: False)
    without = make(configs())
    b = play(without, 3, d)
    assert len(taken) > 100 and len(a) == len(b)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(np.array(x), np.array(y))
    for c1, c2 in zip(with_fast, without):
        (arr1, meta1), (arr2, meta2) = snapshot(c1), snapshot(c2)
        assert meta1 == meta2 and c1.evicted > 0
        for x, y in zip(arr1, arr2):
            np.testing.assert_array_equal(x, y)


def test_fast_path_leaves_a_waiting_group_member_to_the_general_path():
    """With ``fold_at_last_push = False`` the first member of a token still
    holds its last query: it has no victim yet (its last one was written),
    and the fast path's own check refuses it too; its update flushes."""
    caches = grouped(configs(), last_push=False)
    rng = np.random.default_rng(5)
    for L in [5] + [1] * 50:
        token(caches, L, rng)
    group = caches[0]._group
    assert group.waits_for(caches[0]) and caches[0]._victim is None
    k = mx.array(rng.standard_normal((B, HK, 1, D)).astype(np.float32))
    assert not caches[0]._into_victim(k)
    caches[0].update_and_fetch(k, k)
    assert not group.has_pending() and caches[0]._slot is group._victims[0]
