"""Group steps (cache/group.py) against per-layer H2O caches.

Layers in a StepGroup attend evicting decode steps with MLX's SDPA and fold
their queries together once the last member pushed; every decision must be the
per-layer cache's: same kept positions, scores, counts and outputs. On the
CPU the group runs its reference fold (the policy ops on the stacked state);
the GPU kernel is checked against that reference in test_kernels_gpu.py and
tools/gpu_check.py.
"""

import mlx.core as mx
import numpy as np
import pytest

from mlx_h2o import H2OConfig, H2OKVCache, make_h2o_cache
from mlx_h2o.cache import QuantConfig, quantized_cache_type
from mlx_h2o.cache.group import make_groups
from mlx_h2o.config import with_max_size
from mlx_h2o.kernels import gpu_backend
from mlx_h2o.scores import KERNEL_MODES, SCORE_MODES
from tiny_models import VOCAB, teacher_forced, tiny_llama
from decode_steps import queue_of, group_of, members_of

D, HQ, HK, B = 8, 4, 2, 2


def layer_sets(cfgs):
    """Per-layer caches and the same caches in one StepGroup (reference fold)."""
    plain = [H2OKVCache(c) for c in cfgs]
    grouped = [H2OKVCache(c) for c in cfgs]
    make_groups(grouped, size=len(grouped), use_kernel=False)
    return plain, grouped


def token(caches, L, rng, mask=None, sinks=None, d=D):
    """One forward step of a stack of layers: each gets its own random q/k/v."""
    outs = []
    for c in caches:
        q, k, v = (mx.array(rng.standard_normal((B, h, L, d)).astype(np.float32))
                   for h in (HQ, HK, HK))
        m = c.make_mask(L) if mask is None else mask
        keys, values = c.update_and_fetch(k * 3, v)
        outs.append(c.h2o_attention(q, keys, values, scale=0.7, mask=m, sinks=sinks))
    return outs


def filled(caches, seed, steps=50):
    """A prompt of 5 then ``steps`` decode tokens (evicting); the stream's rng."""
    rng = np.random.default_rng(seed)
    for L in [5] + [1] * steps:
        token(caches, L, rng)
    return rng


def run(caches, seed, lengths, check=None, d=D):
    rng = np.random.default_rng(seed)
    outs = []
    for i, L in enumerate(lengths):
        outs.append([np.array(o) for o in token(caches, L, rng, d=d)])
        if check is not None and i in check:
            [c.positions for c in caches]  # reading the metadata releases the group
    return outs


def assert_same(a, b):
    """Same decisions; on the CPU (both sides the policy ops) the same scores,
    on a GPU (per-layer fused kernel vs reference fold) up to summation order."""
    assert (a.offset, a.evicted, a.size()) == (b.offset, b.evicted, b.size())
    n = b.size()
    np.testing.assert_array_equal(np.array(a.positions[..., :n]), np.array(b.positions[..., :n]))
    tol = 0 if mx.default_device() == mx.cpu else 1e-5
    for x, y in ((a.score, b.score), (a.count, b.count)):
        np.testing.assert_allclose(np.array(x[..., :n]), np.array(y[..., :n]), rtol=tol, atol=tol)


def configs(mode="accumulated", sizes=(24, 40, 31)):
    base = H2OConfig(max_size=40, sink_size=2, heavy_budget=15, score=mode, pinned=((5, 7),))
    return [with_max_size(base, s) for s in sizes]


@pytest.mark.parametrize("mode", KERNEL_MODES)
@pytest.mark.parametrize("check", [(), (30, 31, 55)])
def test_group_equals_per_layer(mode, check):
    plain, grouped = layer_sets(configs(mode))
    lengths = [5] + [1] * 30 + [4] + [1] * 40
    a = run(plain, 0, lengths, check)
    b = run(grouped, 0, lengths, check)
    for x, y in zip(a, b):
        for u, v in zip(x, y):
            np.testing.assert_allclose(u, v, rtol=1e-4, atol=1e-5)
    for p, g in zip(plain, grouped):
        assert_same(g, p)
        assert p.evicted > 0
    group = group_of(grouped[0])
    assert group._stacked is None and not group.has_pending()  # reading released it


@pytest.mark.parametrize("mode", sorted(set(SCORE_MODES) - set(KERNEL_MODES)))
def test_modes_without_a_kernel_stay_per_layer(mode):
    """The group fold is a kernel branch per mode: a mode without one
    (scores.ScoreMode.kernel) is never grouped."""
    caches = [H2OKVCache(c) for c in configs(mode)]
    assert not any(c.groupable() for c in caches)
    assert make_groups(caches, size=3, use_kernel=False) == []


def test_group_steps_are_taken_and_stacked():
    """The steady state really runs through the group: metadata stacked, the
    last member's push folds every member at once and hands out the victims,
    no per-layer fold."""
    plain, grouped = layer_sets(configs())
    run(grouped, 1, [5] + [1] * 60)
    group = group_of(grouped[0])
    assert not group.has_pending() and members_of(group, stacked=True) == grouped
    assert group._meta[0].shape == (3 * B, HK, 40)  # padded to the largest layer
    assert all(c.next_victim is v for c, v in zip(grouped, group._victims))
    # The next token's first update writes where the fold told it; no fold there.
    rng = np.random.default_rng(9)
    k = mx.array(rng.standard_normal((B, HK, 1, D)).astype(np.float32))
    grouped[0].update_and_fetch(k, k)
    assert grouped[0].written_slot is group._victims[0] and grouped[0].next_victim is None
    assert not group.has_pending()


def test_release_mid_token_and_masked_step():
    """A masked step of one layer in the middle of a token releases the group:
    the layers before it fold, the rest keep their victims; decisions unchanged."""
    plain, grouped = layer_sets(configs())
    for caches in (plain, grouped):
        rng = filled(caches, 4)
        # A token whose middle layer gets an explicit (all-true) mask.
        mask = mx.ones((1, 1, 1, caches[1].size()), dtype=mx.bool_)
        for i, c in enumerate(caches):
            q, k, v = (mx.array(rng.standard_normal((B, h, 1, D)).astype(np.float32))
                       for h in (HQ, HK, HK))
            keys, values = c.update_and_fetch(k * 3, v)
            c.h2o_attention(q, keys, values, scale=0.7, mask=mask if i == 1 else None)
        for _ in range(10):
            token(caches, 1, rng)
    for p, g in zip(plain, grouped):
        assert_same(g, p)


def test_a_new_decode_step_takes_members_out():
    """A new decode step (set_decode) on grouped members mid-stream: they leave the group
    and decide as per-layer caches from then on."""
    plain, grouped = layer_sets(configs())
    for caches in (plain, grouped):
        rng = filled(caches, 6)
        if caches is grouped:
            group = group_of(grouped[0])
            assert members_of(group, stacked=True) == grouped
            for c in grouped:
                c.set_decode(c.decode.kind)
        for _ in range(20):
            token(caches, 1, rng)
    assert group._stacked is None and not group.has_pending()
    assert group.members == []  # each left when it took another step
    for p, g in zip(plain, grouped):
        assert_same(g, p)


def test_trim_and_state_round_trip():
    plain, grouped = layer_sets(configs())
    for caches in (plain, grouped):
        rng = filled(caches, 7)
        for c in caches:
            c.trim(3)
        for L in [1] * 5:
            token(caches, L, rng)
        states = [c.state for c in caches]
        for c, st in zip(caches, states):
            c.state = st
        for L in [1] * 8:
            token(caches, L, rng)
    for p, g in zip(plain, grouped):
        assert_same(g, p)


def test_members_with_other_shapes_step_alone():
    """A member whose queries differ from the first member's (here: head dim)
    takes per-layer steps; the others still fold together."""
    cfg = configs(sizes=(20, 20))
    plain, grouped = layer_sets(cfg)
    rng = np.random.default_rng(2)
    for L in [5] + [1] * 30:
        for c, d in zip(grouped, (D, 2 * D)):
            q, k, v = (mx.array(rng.standard_normal((B, h, L, d)).astype(np.float32))
                       for h in (HQ, HK, HK))
            keys, values = c.update_and_fetch(k, v)
            c.h2o_attention(q, keys, values, scale=0.5, mask=c.make_mask(L))
    group = group_of(grouped[0])
    assert members_of(group, stacked=True) == [grouped[0]]
    assert grouped[1].evicted > 0 and grouped[1].positions.shape[2] == 20


def test_factory_groups_only_with_a_gpu_backend():
    model = tiny_llama(num_hidden_layers=5)
    caches = make_h2o_cache(model, H2OConfig(max_size=16), layer_budget="uniform")
    on_gpu = gpu_backend() is not None and mx.default_device() == mx.gpu
    assert all((group_of(c) is not None) == on_gpu for c in caches)
    groups = make_groups(caches, size=2, use_kernel=False)
    assert [len(g.members) for g in groups] == [2, 2, 1]
    assert all(group_of(c) is g for g in groups for c in members_of(g))
    assert make_groups(caches, size=0) == []


def test_model_decode_matches_per_layer_caches():
    """A tiny llama, teacher forced past its budget: grouped and per-layer caches
    keep the same tokens and give the same logits."""
    model = tiny_llama()
    cfg = H2OConfig(max_size=24, sink_size=2, heavy_budget=10)
    tokens = mx.array(np.random.default_rng(5).integers(0, VOCAB, (1, 70)))
    plain = make_h2o_cache(model, cfg, layer_budget="uniform")
    grouped = make_h2o_cache(model, cfg, layer_budget="uniform")
    make_groups(grouped, use_kernel=False, size=len(grouped))
    a = teacher_forced(model, plain, tokens, prefill=8)
    b = teacher_forced(model, grouped, tokens, prefill=8)
    np.testing.assert_allclose(np.array(a), np.array(b), rtol=1e-4, atol=1e-4)
    for p, g in zip(plain, grouped):
        assert_same(g, p)


@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_group_equals_per_layer(bits):
    """Quantized caches (one width) take group steps too (by default): on the
    CPU attention by mlx-lm's quantized SDPA ops, the fold over dequantized K;
    same decisions as their per-layer path (scores equal up to rounding: it
    folds quantized_matmul logits)."""
    qt = quantized_cache_type(QuantConfig(bits, 32))
    cfgs = configs(sizes=(24, 40))
    plain, grouped = [qt(c) for c in cfgs], [qt(c) for c in cfgs]
    make_groups(grouped, size=2, use_kernel=False)
    assert group_of(grouped[0]) is not None and group_of(grouped[0]) is group_of(grouped[1])
    quantized_runs_agree(plain, grouped)


def quantized_runs_agree(plain, grouped):
    """A prompt and 60 decode tokens through both stacks (a metadata read
    mid-way): outputs within quantization rounding, the same evictions and
    kept positions, scores up to rounding."""
    lengths = [5] + [1] * 60
    a, b = run(plain, 3, lengths, (45,), d=64), run(grouped, 3, lengths, (45,), d=64)
    for x, y in zip(a, b):
        for u, v in zip(x, y):
            np.testing.assert_allclose(u, v, rtol=1e-3, atol=1e-3)
    for p, g in zip(plain, grouped):
        assert (p.offset, p.evicted) == (g.offset, g.evicted) and p.evicted > 0
        n = p.size()
        np.testing.assert_array_equal(np.array(g.positions[..., :n]),
                                      np.array(p.positions[..., :n]))
        np.testing.assert_allclose(np.array(g.score[..., :n]), np.array(p.score[..., :n]),
                                   rtol=1e-4, atol=1e-5)


def test_mixed_precision_caches_stay_per_layer():
    qt = quantized_cache_type(QuantConfig(8, 32, recent_bits=4))
    caches = [qt(c) for c in configs(sizes=(24, 24))]
    assert caches[0].decode.kind != "reference"  # yet no group: an eviction moves tokens
    assert not caches[0].groupable()  # between zones
    assert make_groups(caches, size=2, use_kernel=False) == []


def test_loaded_caches_are_linked_as_made(tmp_path, monkeypatch):
    """load_prompt_cache sets up what make_h2o_cache does beside the state:
    the layers' fold phases and (GPU: forced here) step groups; decoding on
    from the file then matches decoding on from the live caches."""
    from mlx_h2o.cache import group
    from mlx_h2o.files import load_prompt_cache, save_prompt_cache

    monkeypatch.setattr(group, "max_layers", lambda: 2)  # as if a GPU took 2 a launch
    model = tiny_llama(num_hidden_layers=5)
    cfg = H2OConfig(max_size=16, sink_size=2)
    live = make_h2o_cache(model, cfg, layer_budget="uniform")
    tokens = mx.array(np.random.default_rng(3).integers(0, VOCAB, (1, 30)))
    teacher_forced(model, live, tokens, prefill=8)
    file = str(tmp_path / "c.safetensors")
    save_prompt_cache(file, live)
    loaded = load_prompt_cache(file)
    fresh = make_h2o_cache(model, cfg, layer_budget="uniform")
    phases = [queue_of(c)._head_start for c in loaded]
    assert phases == [queue_of(c)._head_start for c in fresh] and len(set(phases)) > 1
    sizes = lambda cs: sorted(len(g.members) for g in {id(group_of(c)): group_of(c) for c in cs}.values())  # noqa: E731
    assert sizes(loaded) == sizes(live) == [1, 2, 2]
    nxt = mx.array(np.random.default_rng(4).integers(0, VOCAB, (1, 12)))
    a = teacher_forced(model, live, nxt, prefill=1)
    b = teacher_forced(model, loaded, nxt, prefill=1)
    np.testing.assert_array_equal(np.array(a), np.array(b))
    for x, y in zip(live, loaded):
        assert_same(y, x)


def test_deep_copy_goes_on_as_the_original():
    """mlx-lm's prompt LRU deep-copies the caches it hands out: grouped caches
    (whose group holds per-shape plans and MLX dtypes) copy into a new group
    of the copies, and both go on token for token alike."""
    import copy

    _, grouped = layer_sets(configs())
    run(grouped, 1, [5] + [1] * 40)
    copies = copy.deepcopy(grouped)
    group = group_of(copies[0])
    assert group is not group_of(grouped[0]) and members_of(group) == copies
    assert all(group_of(c) is group for c in copies)
    a, b = run(grouped, 2, [1] * 20), run(copies, 2, [1] * 20)
    for x, y in zip(a, b):
        for u, v in zip(x, y):
            np.testing.assert_array_equal(u, v)
    for x, y in zip(grouped, copies):
        assert_same(x, y)


def test_factory_takes_a_decode_step():
    """make_h2o_cache(decode=...) gives every layer that step; a reference
    cache joins no group; a bad name is refused with the choices."""
    model = tiny_llama(num_hidden_layers=3)
    caches = make_h2o_cache(model, H2OConfig(max_size=16), layer_budget="uniform",
                            decode="reference")
    assert all(c.decode.kind == "reference" and group_of(c) is None for c in caches)
    assert make_groups(caches, size=3, use_kernel=False) == []
    with pytest.raises(ValueError, match="decode must be one of"):
        make_h2o_cache(model, H2OConfig(max_size=16), decode="fast")
