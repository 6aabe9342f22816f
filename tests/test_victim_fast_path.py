"""The evicting steady state's fast path (H2OKVCache.into_victim, write_picked_victim).

A full cache whose fused step, compiled CPU step or group fold picked the
next victim writes its decode token there without the general path's checks.
Run with it and with it forced off, every cache must end bit for bit the
same (K/V, metadata, counters, outputs), through the transitions around it: a
prompt chunk after eviction, a trim, a masked step, a group that folds at the
next token (its first member flushes, which the fast path must leave to the
general path) and a released group. Where the general path does more than
the write (a batch eviction, a prompt left uncompacted) the fast path must
decline, which a victim set by hand (as a GPU step sets it) shows on the CPU.
"""

import mlx.core as mx
import numpy as np
import pytest
from dataclasses import replace

from mlx_h2o import H2OKVCache
from mlx_h2o.cache import QuantConfig, quantized_cache_type
from mlx_h2o.cache.group import make_groups
from test_step_group import B, D, HK, configs, layer_sets, token

# Decode, a chunk of 4 past the budget, decode, a trim, decode, a masked step, decode.
SCRIPT = [5] + [1] * 45 + [4] + [1] * 20 + ["trim"] + [1] * 10 + ["mask"] + [1] * 15


def per_layer(cfgs):
    return [H2OKVCache(c) for c in cfgs]


def windowed(cfgs):
    return [H2OKVCache(c, window_size=18) for c in cfgs]


def grouped(cfgs):
    return layer_sets(cfgs)[1]


def quantized(cfgs, group=False):
    qt = quantized_cache_type(QuantConfig(8, 32))
    caches = [qt(c) for c in cfgs]
    if group:
        make_groups(caches, size=len(caches), use_kernel=False)
    return caches


# name -> (caches for configs, head dim)
KINDS = {
    "per_layer": (per_layer, D),
    "window": (windowed, D),
    "grouped": (grouped, D),
    "quantized": (quantized, 64),
    "quantized_grouped": (lambda cfgs: quantized(cfgs, group=True), 64),
}


def play(caches, seed, d, script=SCRIPT):
    rng = np.random.default_rng(seed)
    outs = []
    for step in script:
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


def assert_same_caches(a, b):
    for c1, c2 in zip(a, b):
        (arr1, meta1), (arr2, meta2) = snapshot(c1), snapshot(c2)
        assert meta1 == meta2
        for x, y in zip(arr1, arr2):
            np.testing.assert_array_equal(x, y)


def counting(monkeypatch):
    """Count the fast path's takes (the caches whose update it served; the
    general path writes a victim a flush just picked by the same method)."""
    taken = []
    into = H2OKVCache.into_victim

    def counted(self):
        takes = into(self)
        if takes:
            taken.append(self)
        return takes

    monkeypatch.setattr(H2OKVCache, "into_victim", counted)
    return taken


@pytest.mark.parametrize("mode", ["accumulated", "ema"])
@pytest.mark.parametrize("kind", sorted(KINDS))
def test_fast_path_changes_nothing(kind, mode, monkeypatch):
    make, d = KINDS[kind]
    taken = counting(monkeypatch)
    with_fast = make(configs(mode))
    a = play(with_fast, 3, d)
    n_fast = len(taken)
    assert n_fast > 100  # the steady state really took it

    monkeypatch.setattr(H2OKVCache, "into_victim", lambda self: False)
    without = make(configs(mode))
    b = play(without, 3, d)
    assert len(taken) == n_fast and len(a) == len(b)  # off means off
    for x, y in zip(a, b):
        np.testing.assert_array_equal(np.array(x), np.array(y))
    assert_same_caches(with_fast, without)
    assert all(c.evicted > 0 for c in with_fast)


def test_fast_path_keeps_the_scores_check():
    """A fast-path update leaves the step waiting for its scores: a second
    update before the attention is the usual error."""
    caches = per_layer(configs())
    play(caches, 2, D, [5] + [1] * 40)
    c = caches[0]
    assert c.next_victim is not None and c.into_victim()
    k = mx.zeros((B, HK, 1, D))
    c.update_and_fetch(k, k)
    with pytest.raises(RuntimeError, match="before the attention"):
        c.update_and_fetch(k, k)


@pytest.mark.parametrize("case", ["evict_batch", "prompt_left_long"])
def test_fast_path_declines_where_the_general_path_does_more(case, monkeypatch):
    """A victim set by hand, as a GPU step leaves it, where the general path
    must evict a batch or compact the prompt first: the fast path is not
    taken, and the caches end as with it forced off."""
    if case == "evict_batch":
        # After 5 + 31 tokens a layer of 24 with batches of 4 is full again:
        # its next decode token evicts a batch.
        cfgs = [replace(c, evict_batch=4) for c in configs(sizes=(24, 24))]
        script = [5] + [1] * 31
    else:
        cfgs = [replace(c, prefill_compact="prompt", prefill_window=2) for c in configs()]
        script = [5] + [1] * 40 + [30]
    taken = counting(monkeypatch)
    runs = []
    for fast in (True, False):
        if not fast:
            monkeypatch.setattr(H2OKVCache, "into_victim", lambda self: False)
        caches = per_layer(cfgs)
        play(caches, 4, D, script)
        rng = np.random.default_rng(7)
        for c in caches:  # a victim per (sequence, KV head), as a fused step's
            c.next_victim = mx.array(rng.integers(3, 20, (B, HK, 1, 1)).astype(np.int32))
            c.next_victim = mx.broadcast_to(c.next_victim, (B, HK, 1, D))
        over = caches[0].size() - cfgs[0].max_size
        assert over == (0 if case == "evict_batch" else 30)
        before = len(taken)
        outs = play(caches, 5, D, [1])
        assert len(taken) == before  # declined: the general path evicted / compacted
        outs += play(caches, 6, D, [1] * 6)
        runs.append((caches, outs))
    for x, y in zip(runs[0][1], runs[1][1]):
        np.testing.assert_array_equal(np.array(x), np.array(y))
    assert_same_caches(runs[0][0], runs[1][0])


