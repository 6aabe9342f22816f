"""prefill_compact="prompt": a prompt prefilled in several chunks is compacted
once, at the first decode step, and its last chunk's window picks what stays."""

import json

import mlx.core as mx
import numpy as np
import pytest
from test_cache import check_invariants, kept_positions, step
from tiny_models import BUILDERS, VOCAB

import mlx_h2o
from mlx_h2o import H2OConfig, H2OKVCache, make_h2o_cache
from mlx_h2o.cache import (
    MixedPrecisionH2OKVCache,
    QuantConfig,
    QuantizedH2OKVCache,
)
from mlx_h2o.files import load_prompt_cache, save_prompt_cache
from mlx_h2o.cache.group import link_layers
from mlx_h2o.cli.generate import h2o_config_from_args, setup_arg_parser
from mlx_h2o.config import config_from_dict, config_to_dict
from mlx_h2o.eval.strategies import parse_strategy
from mlx_h2o.scores import SCORE_MODES, SCORES

SUMMED = [n for n, m in SCORES.items() if m.fold == "sum"]  # chunks add up

CFG = dict(max_size=16, sink_size=2, heavy_budget=6)


def prompt_cfg(**kw):
    return H2OConfig(**{**CFG, "prefill_compact": "prompt", **kw})


def check_uncompacted(cache, seen):
    """Mid-prompt: every token seen since the last compaction is still there."""
    pos = kept_positions(cache)
    assert cache.offset == seen and cache.size() == pos.shape[-1] > cache.max_size
    for row in pos.reshape(-1, pos.shape[-1]):
        assert len(set(row.tolist())) == len(row)
        assert set(range(seen - 10, seen)) <= set(row.tolist())


def check_compacted(cache, seen, cfg):
    if cache.window_size is None:
        return check_invariants(cache, seen, cfg)
    # A window layer evicts what it can no longer see first, sinks included.
    pos = kept_positions(cache)
    assert cache.offset == seen and cache.size() == cfg.max_size == pos.shape[-1]
    visible = set(range(seen - min(cache.window_size, cfg.recent_budget), seen))
    for row in pos.reshape(-1, pos.shape[-1]):
        assert len(set(row.tolist())) == len(row) and visible <= set(row.tolist())


@pytest.mark.parametrize("score", SCORE_MODES)
@pytest.mark.parametrize("window", [None, 9])
def test_grows_through_the_prompt_then_compacts_at_first_decode(score, window):
    cfg = prompt_cfg(score=score, prefill_window=4, prefill_pool=3)
    rng, cache, seen = np.random.default_rng(0), H2OKVCache(cfg, window_size=window), 0
    for L in [10, 12, 12]:
        step(cache, L, rng)
        seen += L
        if seen > cfg.max_size:
            check_uncompacted(cache, seen)
    assert cache.size() == 34 and cache.evicted == 0
    for _ in range(6):
        step(cache, 1, rng)
        seen += 1
        check_compacted(cache, seen, cfg)
    # A second prompt, after decoding: grows again, compacts again.
    for L in [11, 10, 1, 1]:
        step(cache, L, rng)
        seen += L
    check_compacted(cache, seen, cfg)


def test_chunk_mode_compacts_every_chunk():
    cache, rng = H2OKVCache(H2OConfig(**CFG)), np.random.default_rng(0)
    for L in [10, 12, 12]:
        step(cache, L, rng)
        assert cache.size() <= 16


def one_hot_stream(cache, chunks):
    """Drive ``cache`` with hand-made vectors: key p is ``4 * e_p`` for the
    positions in ``marked`` (else 0); a chunk's queries are ``4 * e_target``.

    ``chunks`` is a list of (length, target position or None)."""
    D, marked, offset = 16, (1, 3), cache.offset
    for L, target in chunks:
        k = np.zeros((1, 1, L, D), np.float32)
        for p in marked:
            if offset <= p < offset + L:
                k[0, 0, p - offset, p] = 4.0
        q = np.zeros((1, 1, L, D), np.float32)
        if target is not None:
            q[..., target] = 4.0
        mask = cache.make_mask(L)
        keys, values = cache.update_and_fetch(mx.array(k), mx.array(k))
        cache.h2o_attention(mx.array(q), keys, values, scale=1.0, mask=mask)
        offset += L


@pytest.mark.parametrize("mode, survives", [("chunk", False), ("prompt", True)])
def test_needle_only_the_last_window_attends_to(mode, survives):
    # One heavy slot. Position 1 is a decoy the first chunk's window attends
    # to; position 3 is the needle only the last chunk's window attends to.
    # Under "chunk" the first compaction drops the needle before its question
    # comes; the last window then replaces the decoy's score in either mode.
    cfg = H2OConfig(
        max_size=6, sink_size=1, heavy_budget=1, prefill_window=2, prefill_pool=0,
        prefill_compact=mode,
    )
    cache = H2OKVCache(cfg)
    one_hot_stream(cache, [(8, 1), (8, 3), (1, None)])
    kept = set(kept_positions(cache).ravel().tolist())
    assert cache.size() == 6 and cache.offset == 17
    assert (3 in kept) == survives
    assert 1 not in kept


def test_later_chunk_replaces_the_earlier_window():
    cfg = H2OConfig(max_size=6, sink_size=1, heavy_budget=1, prefill_window=2,
                    prefill_pool=0, prefill_compact="prompt")
    cache = H2OKVCache(cfg)
    one_hot_stream(cache, [(8, 1)])
    assert float(cache.score[0, 0, 1]) > 1.9  # both window queries on the decoy
    one_hot_stream(cache, [(8, 3)])
    score = np.array(cache.score[0, 0, : cache.size()])
    assert score[1] < 1e-3 and score[3] > 1.9
    np.testing.assert_allclose(score.sum(), 2.0, rtol=1e-5)  # one window of 2 queries


def test_short_last_chunk_adds_to_the_previous_window():
    cfg = H2OConfig(max_size=6, sink_size=1, heavy_budget=1, prefill_window=4,
                    prefill_pool=0, prefill_compact="prompt")
    cache = H2OKVCache(cfg)
    one_hot_stream(cache, [(8, 1), (2, 3)])  # 2 < prefill_window queries
    score = np.array(cache.score[0, 0, : cache.size()])
    assert score[1] > 3.9 and score[3] > 1.9  # 4 + 2 queries


@pytest.mark.parametrize("score", SCORE_MODES)
@pytest.mark.parametrize("window", [None, 7])
@pytest.mark.parametrize("stream", [[25] + [1] * 8, [6, 1, 1, 23, 1, 1, 30, 1, 1, 14, 1]])
def test_single_chunk_prompts_match_chunk_mode(score, window, stream):
    caches = [
        H2OKVCache(H2OConfig(**CFG, score=score, prefill_compact=m), window_size=window)
        for m in ("chunk", "prompt")
    ]
    outs = [[step(c, L, np.random.default_rng(i)) for i, L in enumerate(stream)] for c in caches]
    for a, b in zip(*outs):
        np.testing.assert_array_equal(np.array(a), np.array(b))
    for x, y in zip(caches[0].state, caches[1].state):
        np.testing.assert_array_equal(np.array(x), np.array(y))
    assert caches[0].evicted == caches[1].evicted


@pytest.mark.parametrize("score", SUMMED)
def test_chunked_prompt_keeps_what_one_chunk_keeps(score):
    """Under "prompt", 40 tokens in chunks of 16 / 16 / 8 keep the same tokens
    as the 40 tokens in one chunk (either mode): the last window decides."""
    B, D, HQ, HK = 2, 8, 4, 2
    rng = np.random.default_rng(7)
    q, k, v = (mx.array(rng.standard_normal((B, h, 41, D)).astype(np.float32) * 2)
               for h in (HQ, HK, HK))

    def run(cfg, bounds):
        cache = H2OKVCache(cfg)
        for s, e in zip(bounds, bounds[1:]):
            mask = cache.make_mask(e - s)
            keys, values = cache.update_and_fetch(k[:, :, s:e], v[:, :, s:e])
            cache.h2o_attention(q[:, :, s:e], keys, values, scale=1.0, mask=mask)
        return np.sort(kept_positions(cache), -1)

    cfg = dict(CFG, score=score, prefill_window=6, prefill_pool=3)
    one = run(H2OConfig(**cfg), [0, 40, 41])
    np.testing.assert_array_equal(run(prompt_cfg(**cfg), [0, 16, 32, 40, 41]), one)
    chunked = run(H2OConfig(**cfg), [0, 16, 32, 40, 41])
    assert not np.array_equal(chunked, one)  # the point of the option


def test_save_load_mid_prompt(tmp_path):
    cfg = prompt_cfg(score="normalized")
    rng = np.random.default_rng(4)
    cache = [H2OKVCache(cfg), H2OKVCache(cfg, window_size=6)]
    link_layers(cache)  # as the loader links its caches: on a GPU, the same step groups
    for L in [15, 1, 12, 9]:
        for c in cache:
            step(c, L, rng)
    assert all(c.size() > cfg.max_size for c in cache)
    path = str(tmp_path / "prompt.safetensors")
    save_prompt_cache(path, cache)
    loaded = load_prompt_cache(path)
    for a, b in zip(cache, loaded):
        assert (a.offset, a.evicted, a.config, a.size()) == (b.offset, b.evicted, b.config, b.size())
        assert b.config.prefill_compact == "prompt"
        for x, y in zip(a.state, b.state):
            np.testing.assert_array_equal(np.array(x), np.array(y))
        outs = [[step(c, L, np.random.default_rng(9 + L)) for L in (10, 1, 1)] for c in (a, b)]
        for x, y in zip(*outs):
            np.testing.assert_array_equal(np.array(x), np.array(y))
        assert b.size() == cfg.max_size
        np.testing.assert_array_equal(kept_positions(a), kept_positions(b))


def test_state_and_nbytes_mid_prompt():
    cache, rng = H2OKVCache(prompt_cfg()), np.random.default_rng(1)
    for L in [12, 12]:
        step(cache, L, rng)
    *kv, positions, score, count = cache.state
    assert all(a.shape[2] == 24 for a in (*kv, positions, score, count))
    assert cache.nbytes >= sum(a.nbytes for a in cache.state)
    restored = H2OKVCache.from_state(cache.state, cache.meta_state)
    assert restored.size() == 24 and restored.offset == 24


def test_trim_mid_prompt():
    cfg = prompt_cfg()
    cache, rng = H2OKVCache(cfg), np.random.default_rng(2)
    for L in [10, 12]:
        step(cache, L, rng)
    assert cache.is_trimmable() and cache.trim(5) == 5
    assert cache.offset == 17 and cache.size() == 17
    assert kept_positions(cache).max() == 16
    step(cache, 1, rng)  # still over budget: the decode step compacts
    check_invariants(cache, 18, cfg)
    assert kept_positions(cache).max() == 17


def test_quantized_caches_compact_at_first_decode():
    D, HQ, HK = 64, 4, 2
    rng = np.random.default_rng(3)
    cfg = prompt_cfg()
    caches = [
        QuantizedH2OKVCache(cfg, quant=QuantConfig(8, 32)),
        MixedPrecisionH2OKVCache(cfg, quant=QuantConfig(8, 32, 4)),
    ]
    for cache in caches:
        seen = 0
        for L in [10, 12, 12, 1, 1, 9, 1]:
            q, k, v = (mx.array(rng.standard_normal((2, h, L, D)).astype(np.float32))
                       for h in (HQ, HK, HK))
            mask = cache.make_mask(L)
            keys, values = cache.update_and_fetch(k, v)
            cache.h2o_attention(q, keys, values, scale=D**-0.5, mask=mask)
            seen += L
            if L == 1:
                check_invariants(cache, seen, cfg)
        assert cache.size() == cfg.max_size


@pytest.mark.parametrize("arch", sorted(BUILDERS))
def test_model_prefill_in_chunks(arch):
    model = BUILDERS[arch]()
    tokens = mx.random.randint(0, VOCAB, (2, 48))
    cache = make_h2o_cache(model, prompt_cfg(max_size=24, heavy_budget=None))
    h2o = [c for c in cache if isinstance(c, H2OKVCache)]
    with mlx_h2o.patch():
        for s in range(0, 40, 16):
            model(tokens[:, s : min(s + 16, 40)], cache=cache)
        assert all(c.size() == 40 and c.evicted == 0 for c in h2o)
        for t in range(40, 48):
            model(tokens[:, t : t + 1], cache=cache)
            assert all(c.size() == 24 for c in h2o)
    assert all(c.offset == 48 for c in h2o)


def test_config_value_dict_and_options():
    with pytest.raises(ValueError, match=r"prefill_compact='end'.*\('chunk', 'prompt', 'preview', 'two_pass'\)"):
        H2OConfig(max_size=8, prefill_compact="end")
    assert H2OConfig(max_size=8).prefill_compact == "preview"
    # "chunk" (the rule before the option) is left out of the dict: saved
    # caches and result keys from before it read back as "chunk".
    chunk = H2OConfig(max_size=8, prefill_compact="chunk")
    assert "prefill_compact" not in config_to_dict(chunk)
    old = json.loads(json.dumps(config_to_dict(chunk)))
    assert config_from_dict(old) == chunk
    for mode in ("prompt", "preview", "two_pass"):
        cfg = H2OConfig(max_size=8, prefill_compact=mode)
        assert config_from_dict(config_to_dict(cfg)) == cfg
    s = parse_strategy("h2o-heavy:prefill_compact=prompt,layer_budget=uniform")
    assert s.h2o_config(1024).prefill_compact == "prompt"
    assert s.key(1024) != parse_strategy("h2o-heavy:layer_budget=uniform").key(1024)
    with pytest.raises(ValueError, match="prefill_compact"):
        parse_strategy("h2o-heavy:prefill_compact=never")


def test_cli_flag():
    parse = lambda *a: setup_arg_parser().parse_args(list(a))  # noqa: E731
    assert h2o_config_from_args(parse()).prefill_compact == "preview"
    cfg = h2o_config_from_args(parse("--h2o-prefill-compact", "prompt"))
    assert cfg.prefill_compact == "prompt"
    with pytest.raises(SystemExit):
        parse("--h2o-prefill-compact", "end")
