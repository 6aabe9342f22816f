"""Per-layer budgets: allocation at a fixed total, per-layer configs, strategies."""

import dataclasses

import mlx.core as mx
import numpy as np
import pytest

from mlx_h2o import H2OConfig, H2OKVCache, make_h2o_cache
from mlx_h2o.budgets import allocate_layer_sizes, layer_sizes
from mlx_h2o.config import with_max_size
from mlx_h2o.eval.strategies import parse_strategy
from mlx_h2o.profiles import LayerProfile, save_profile
from tiny_models import VOCAB, teacher_forced as run, tiny_gemma3, tiny_llama


# --- allocation -------------------------------------------------------------


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("max_kv", [7, 64, 256])
def test_allocation_sum_bounds_and_monotone(seed, max_kv):
    rng = np.random.default_rng(seed)
    w = list(rng.lognormal(0, 1.5, size=30))
    lo, hi = max_kv // 4, 4 * max_kv
    s = allocate_layer_sizes(w, max_kv * 30, lo, hi)
    assert sum(s) == max_kv * 30
    assert all(lo <= x <= hi for x in s)
    order = np.argsort(w, kind="stable")
    assert all(np.diff(np.array(s)[order]) >= 0)  # more spread -> never fewer slots


def test_allocation_is_proportional_without_clipping():
    assert allocate_layer_sizes([1, 2, 3, 4], 1000, 1, 1000) == [100, 200, 300, 400]
    assert allocate_layer_sizes([1, 1, 1], 10, 1, 10) == [4, 3, 3]
    assert allocate_layer_sizes([5, 5], 512, 64, 1024) == [256, 256]


def test_allocation_clips_and_redistributes():
    s = allocate_layer_sizes([100, 1, 1, 1], 1024, 64, 512)
    assert s[0] == 512 and sum(s) == 1024 and min(s) >= 64
    # per-layer caps (sliding windows) are honoured
    s = allocate_layer_sizes([100, 100, 1, 1], 1024, 64, [300, 1024, 1024, 1024])
    assert s[0] == 300 and sum(s) == 1024


@pytest.mark.parametrize(
    "args, match",
    [
        (([1, 2], 100, 60, 100), "outside"),
        (([1, 2], 500, 60, 100), "outside"),
        (([1, -1], 100, 10, 100), "finite"),
        (([0, 0], 100, 10, 100), "not all 0"),
        (([1, 2], 100, 10, [100]), "1 entries for 2 layers"),
        (([1, 2], 100, [60, 60], [50, 100]), "exceed"),
    ],
)
def test_allocation_errors(args, match):
    with pytest.raises(ValueError, match=match):
        allocate_layer_sizes(*args)


def test_calibrated_sizes_respect_windows_and_total():
    s = layer_sizes([50.0, 1.0, 1.0, 50.0], (None, 300, 300, None), 256, sink=4)
    assert sum(s) == 4 * 256 and min(s) >= 64 and max(s) <= 1024
    s = layer_sizes([1.0, 50.0, 50.0, 1.0], (None, 300, 300, None), 256, sink=4)
    assert s[1] == s[2] == 300 and sum(s) == 4 * 256
    with pytest.raises(ValueError, match="3 layer weights for 4"):
        layer_sizes([1.0] * 3, (None,) * 4, 256, sink=4)
    with pytest.raises(ValueError, match="max_kv=5 is below sink \\+ 2"):
        layer_sizes([1.0] * 3, (None,) * 3, 5, sink=4)


def test_sizes_at_budgets_above_a_sliding_window():
    # A window layer can use at most its window: the total is the memory a uniform
    # budget can use (min(max_kv, window) per window layer), and equal weights
    # give exactly that uniform budget.
    windows = (16, 16, None)
    assert layer_sizes([1.0, 1.0, 1.0], windows, 64, sink=4) == [16, 16, 64]
    s = layer_sizes([1.0, 1.0, 5.0], windows, 64, sink=4)
    assert s[:2] == [16, 16] and s[2] == 64  # the full layer cannot take the windows' slots
    s = layer_sizes([5.0, 1.0, 1.0], windows, 64, sink=4)
    assert s[0] == 16 and sum(s) == 96 and s[1] >= 16 // 4
    # at or below the window, the rule of the per-layer budgets (docs/GUIDE.md; total max_kv x layers)
    assert layer_sizes([1.0, 1.0, 1.0], windows, 16, sink=4) == [16, 16, 16]
    assert sum(layer_sizes([1.0, 3.0, 9.0], windows, 16, sink=4)) == 48


# --- per-layer configs ------------------------------------------------------


def test_with_max_size_scales_the_split():
    cfg = H2OConfig(max_size=256, sink_size=4, heavy_budget=128)  # s4 h128 r124
    assert with_max_size(cfg, 256) == cfg
    small = with_max_size(cfg, 64)
    assert (small.sink_size, small.heavy_budget, small.recent_budget) == (4, 30, 30)
    big = with_max_size(cfg, 1024)
    assert (big.sink_size, big.heavy_budget, big.recent_budget) == (4, 518, 502)  # 128 * 1020 / 252 = 518.1
    assert small.score == cfg.score and small.prefill_pool == cfg.prefill_pool
    tiny = with_max_size(H2OConfig(max_size=256, heavy_budget=251), 6)
    assert (tiny.heavy_budget, tiny.recent_budget) == (1, 1)  # recent never 0


def test_with_max_size_errors():
    cfg = H2OConfig(max_size=64, sink_size=4, pinned=((10, 30),))
    with pytest.raises(ValueError, match="below sink_size \\+ 2 = 6"):
        with_max_size(cfg, 5)
    with pytest.raises(ValueError, match="positions, which exceed heavy_budget"):
        with_max_size(cfg, 16)


def test_layer_sizes_honoured_and_total_memory_uniform():
    model = tiny_llama(num_hidden_layers=3)
    cfg = H2OConfig(max_size=16, sink_size=2, heavy_budget=8)
    sizes = [8, 28, 12]
    cache = make_h2o_cache(model, cfg, layer_sizes=sizes)
    assert [c.max_size for c in cache] == sizes
    assert sum(c.max_size for c in cache) == 3 * cfg.max_size
    tokens = mx.random.randint(0, VOCAB, (2, 60))
    run(model, cache, tokens, 20)
    for c, size in zip(cache, sizes):
        assert c.offset == 60 and c.size() == size and c.evicted == 60 - size
        pos = np.sort(np.array(c.positions[..., : c.size()]), axis=-1)  # (B, Hk, size)
        assert (pos[..., :2] == [0, 1]).all()  # sinks kept
        recent = c.config.recent_budget
        assert (pos[..., -recent:] == np.arange(60 - recent, 60)).all()
        assert all(len(np.unique(row)) == size for row in pos.reshape(-1, size))


def test_uniform_layer_sizes_equal_no_layer_sizes():
    model = tiny_llama()
    cfg = H2OConfig(max_size=16, sink_size=2, heavy_budget=8)
    tokens = mx.random.randint(0, VOCAB, (1, 40))
    a = run(model, make_h2o_cache(model, cfg), tokens, 10)
    b = run(model, make_h2o_cache(model, cfg, layer_sizes=[16, 16]), tokens, 10)
    assert mx.array_equal(a, b)


def test_layer_sizes_keep_sliding_windows():
    from mlx_lm.models.cache import make_prompt_cache

    model = tiny_gemma3()
    cache = make_h2o_cache(model, H2OConfig(max_size=40), layer_sizes=[16, 40, 64])
    assert [c.window_size for c in cache] == [16, 16, None]
    assert [c.max_size for c in cache] == [16, 40, 64]
    # Window layers at or above their window lose nothing: logits match mlx-lm's.
    tokens = mx.random.randint(0, VOCAB, (1, 60))
    ref = run(model, make_prompt_cache(model), tokens, 20)
    out = run(model, cache, tokens, 20)
    np.testing.assert_allclose(np.array(out), np.array(ref), atol=2e-4, rtol=1e-4)


@pytest.mark.parametrize(
    "sizes, match",
    [([16], "1 entries but the model has 2 attention layers"),
     ([16, 3], r"layer_sizes\[1\]=3: max_size=3 is below sink_size \+ 2"),
     ([16, 8.5], r"layer_sizes\[1\]=8.5: max_size must be an int")],
)
def test_layer_sizes_errors(sizes, match):
    with pytest.raises((ValueError, TypeError), match=match):
        make_h2o_cache(tiny_llama(), H2OConfig(max_size=16), layer_sizes=sizes)


# --- strategies -------------------------------------------------------------


def test_layer_budget_strategy():
    model = tiny_llama(num_hidden_layers=3)
    st = parse_strategy("h2o-heavy:layer_budget=entropy")
    assert st.layer_budget == "entropy"
    with pytest.raises(ValueError, match="calibrated"):
        st.make_cache(model, 32)
    profile = LayerProfile(statistic="entropy", weights=(9.0, 1.0, 2.0), attention_layers=3,
                           windows=(None,) * 3)
    st = dataclasses.replace(st, profile=profile, layer_windows=(None,) * 3)
    cache = st.make_cache(model, 32)
    sizes = [c.max_size for c in cache]
    assert sum(sizes) == 96 and sizes[0] > sizes[2] > sizes[1] >= 8
    d = st.describe(32)
    assert d["layer_sizes"] == sizes and d["layer_budget"] == "entropy"
    uniform = parse_strategy("h2o-heavy:layer_budget=uniform")
    assert st.key(32) != uniform.key(32) and uniform.layer_sizes(32) is None


def test_strategy_keys_name_the_resolved_budget(tmp_path):
    model = tiny_llama(num_hidden_layers=3)
    uniform = parse_strategy("h2o-heavy:layer_budget=uniform")
    auto = parse_strategy("h2o-heavy").calibrated(model)  # a random model: uniform
    assert uniform.key(32) == auto.key(32) == parse_strategy("h2o-heavy").calibrated(
        model).key(32)
    assert uniform.key(32).startswith("h2o-heavy-")  # the key of results before profiles
    with pytest.raises(ValueError, match="calibrated"):
        parse_strategy("h2o-heavy").key(32)  # "auto" depends on the model
    path = tmp_path / "p.json"
    windows = (None,) * 3
    save_profile(LayerProfile(statistic="invtopk", weights=(1.0, 2.0, 3.0),
                              attention_layers=3, windows=windows), path)
    from_file = parse_strategy(f"h2o-heavy:score=normalized,layer_budget={path}")
    from_file = from_file.calibrated(model)
    assert from_file.key(32).startswith("h2o-heavy:score=normalized,layer_budget=invtopk-")
    assert [c.max_size for c in from_file.make_cache(model, 32)] == [16, 32, 48]
    same = dataclasses.replace(parse_strategy("h2o-heavy:score=normalized,layer_budget=topk"),
                               profile=from_file.profile, layer_windows=windows)
    assert same.key(32) == from_file.key(32)  # same config and sizes: one key
    assert from_file.describe(32)["layer_profile"] == str(path)


@pytest.mark.parametrize(
    "spec", ["h2o-heavy:layer_budget=spread", "rotating:layer_budget=entropy",
             "h2o-heavy:layer_budget=3"]
)
def test_layer_budget_strategy_errors(spec):
    with pytest.raises(ValueError, match="layer_budget|takes only"):
        parse_strategy(spec)
