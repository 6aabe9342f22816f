"""prefill_compact="preview": the prompt's end, run ahead through the model
alone, scores every chunk compacted before the end arrives."""

import dataclasses

import mlx.core as mx
import mlx_lm.models.base as mlx_base
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache
from test_cache import check_invariants, kept_positions
from test_integration import word_tokenizer
from tiny_models import BUILDERS, VOCAB, tiny_gemma3, tiny_llama

import mlx_h2o
from mlx_h2o import H2OConfig, H2OKVCache, make_h2o_cache, preview_prompt
from mlx_h2o.cache import chunk
from mlx_h2o.cache.storage import DenseKV
from mlx_h2o.config import config_from_dict, config_to_dict
from mlx_h2o.integration.preview import preview_window
from mlx_h2o.scores import SCORE_MODES, score_mode

D = 8


def _softmax_rows(logits, sinks):
    top = logits.max(axis=-1, keepdims=True)
    if sinks is not None:
        top = np.maximum(top, sinks[None, :, None, None])
    e = np.exp(logits - top)
    den = e.sum(axis=-1, keepdims=True)
    if sinks is not None:
        den = den + np.exp(sinks[None, :, None, None] - top)
    return e / den


@pytest.mark.parametrize("mode", SCORE_MODES)
@pytest.mark.parametrize("hq,hk", [(2, 2), (4, 2), (6, 1)])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_preview_columns_match_float64(mode, hq, hk, with_sinks):
    rng = np.random.default_rng(hq * 10 + hk + with_sinks)
    B, W, N = 2, 5, 37
    q, k, v = (rng.standard_normal(s) for s in ((B, hq, W, D), (B, hk, N, D), (B, hk, N, D)))
    sinks = rng.standard_normal(hq) if with_sinks else None
    held = (rng.random((B, hk, N)), rng.integers(0, 4, (B, hk, N)).astype(float))
    scale = D ** -0.5
    step, seen = chunk.with_preview(
        DenseKV(), mode, hk, tuple(mx.array(a.astype(np.float32)) for a in held),
        mx.array(q.astype(np.float32)), mx.array(k.astype(np.float32)),
        mx.array(v.astype(np.float32)), scale,
        None if sinks is None else mx.array(sinks.astype(np.float32)))
    logits = scale * q @ np.repeat(k, hq // hk, axis=1).swapaxes(-1, -2)  # (B, hq, W, N)
    spec = score_mode(mode)
    mag = np.abs(logits) if spec.magnitude == "abs_logit" else _softmax_rows(logits, sinks)
    want = mag.reshape(B, hk, hq // hk, W, N).mean(axis=2).sum(axis=2)
    np.testing.assert_allclose(np.array(seen), held[1] + W, rtol=0, atol=0)
    if spec.fold == "fixed":
        assert step is None
    else:
        np.testing.assert_allclose(np.array(step), held[0] + want, rtol=2e-5, atol=2e-5)


CFG = dict(max_size=16, sink_size=2, heavy_budget=6, prefill_window=4, prefill_pool=0)


def _needle_prompt(seed, L=36, needle=10, B=2, hq=2, hk=1):
    """(q, k, v) of a prompt whose keys at ``needle`` point along ``u``, and
    whose last 4 queries (the question) ask for ``u``."""
    rng = np.random.default_rng(seed)
    q, k, v = (rng.standard_normal((B, h, L, D)).astype(np.float32) for h in (hq, hk, hk))
    u = np.zeros(D, np.float32)
    u[0] = 1.0
    k[:, :, needle] = 4.0 * u
    q[:, :, -4:] = 4.0 * u
    return q, k, v


def _prefill(cfg, q, k, v, chunks, preview=False):
    cache, s = H2OKVCache(H2OConfig(**cfg)), 0
    if preview:
        cache.set_preview(mx.array(q[:, :, -4:]), q.shape[2] - 4)
    for L in chunks:
        keys, values = cache.update_and_fetch(mx.array(k[:, :, s:s + L]),
                                              mx.array(v[:, :, s:s + L]))
        cache.h2o_attention(mx.array(q[:, :, s:s + L]), keys, values, scale=D ** -0.5,
                            mask="causal")
        s += L
        check_invariants(cache, s, cache.config)
        assert (cache.preview is None) == (not preview or s > q.shape[2] - 4)
    return kept_positions(cache)


@pytest.mark.parametrize("seed", [0, 1, 3])  # seeds whose chunks drop it by chance too
def test_the_ends_queries_keep_a_needle_that_chunks_before_it_drop(seed):
    q, k, v = _needle_prompt(seed)
    chunks = [12, 12, 12]
    plain = _prefill({**CFG, "prefill_compact": "chunk"}, q, k, v, chunks)
    assert not (plain == 10).any(axis=-1).any()  # the chunk before the question drops it
    seen = _prefill({**CFG, "prefill_compact": "preview"}, q, k, v, chunks, preview=True)
    assert (seen == 10).any(axis=-1).all()  # every row and head keeps it
    # Not previewed, "preview" is "chunk".
    np.testing.assert_array_equal(
        _prefill({**CFG, "prefill_compact": "preview"}, q, k, v, chunks), plain)


def test_preview_applies_only_to_the_preview_mode_and_global_layers():
    q = mx.zeros((1, 2, 4, D))
    for compact, window, wants in [("chunk", None, False), ("prompt", None, False),
                                   ("preview", None, True), ("preview", 8, False)]:
        cache = H2OKVCache(H2OConfig(**{**CFG, "prefill_compact": compact}), window_size=window)
        assert cache.wants_preview() is wants
        cache.set_preview(q, 20)
        assert (cache.preview is not None) is wants


def test_preview_after_the_prompt_began_is_refused():
    cache = H2OKVCache(H2OConfig(**{**CFG, "prefill_compact": "preview"}))
    cache.update_and_fetch(mx.zeros((1, 1, 6, D)), mx.zeros((1, 1, 6, D)))
    cache.h2o_attention(mx.zeros((1, 2, 6, D)), *cache.kv.fetch(6), scale=1.0, mask="causal")
    with pytest.raises(ValueError, match="before it is prefilled"):
        cache.set_preview(mx.zeros((1, 2, 4, D)), 2)


def _recorded_queries(model, tokens):
    """Each layer's queries for ``tokens`` run alone from position 0 (mlx-lm's caches)."""
    seen, original = [], mlx_base.scaled_dot_product_attention

    def record(queries, keys, values, cache, scale, mask, sinks=None):
        seen.append(queries)
        return original(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)

    modules = [m for m in mlx_h2o.integration.routing._model_modules()
               if getattr(m, "scaled_dot_product_attention", None) is original]
    for m in modules:
        m.scaled_dot_product_attention = record
    try:
        model(tokens, cache=[KVCache() for _ in model.layers])
    finally:
        for m in modules:
            m.scaled_dot_product_attention = original
    return seen


def _shifted(attn, queries, by: int):
    """RoPE rotations compose: each query moved on by ``by`` positions."""
    return mx.concatenate([attn.rope(queries[:, :, i:i + 1], offset=by)
                           for i in range(queries.shape[2])], axis=2)


@pytest.mark.parametrize("arch,read", [("llama", 20), ("qwen3", 20), ("llama", 8), ("llama", 3)])
def test_preview_prompt_gives_each_layer_the_ends_queries_at_their_positions(
        arch, read, monkeypatch):
    monkeypatch.setattr(mlx_h2o.integration.preview, "PREVIEW_TOKENS", read)
    model = BUILDERS[arch]()
    L, W = 50, 8
    P = max(read, W)  # the pass reads at least the window
    tokens = mx.random.randint(0, VOCAB, (2, L), key=mx.random.key(1))
    cache = make_h2o_cache(model, H2OConfig(max_size=16, prefill_window=W,
                                            prefill_compact="preview"))
    preview_prompt(model, cache, tokens)
    # The end's hidden states do not depend on where it sits (attention
    # among its own tokens is relative): the last W queries of the last P
    # tokens run from position 0, rotated on by L - P, are the preview's.
    alone = _recorded_queries(model, tokens[:, L - P:])
    for layer, c, q0 in zip(model.layers, cache, alone):
        assert c.preview_from == L - W and c.preview.shape[2] == W
        want = _shifted(layer.self_attn, q0, L - P)[:, :, -W:]
        np.testing.assert_allclose(np.array(c.preview), np.array(want), rtol=1e-4, atol=1e-4)


def test_gemma_previews_its_global_layers_only():
    model = tiny_gemma3()
    cache = make_h2o_cache(model, H2OConfig(max_size=24, prefill_window=4,
                                            prefill_compact="preview"))
    preview_prompt(model, cache, mx.arange(40) % VOCAB)
    got = [c.preview is not None for c in cache]
    assert got == [c.window_size is None for c in cache] and any(got) and not all(got)


def test_preview_prompt_does_nothing_where_no_cache_asks():
    model = tiny_llama()
    plain = make_h2o_cache(model, H2OConfig(max_size=16, prefill_compact="chunk"))
    stock = [KVCache() for _ in model.layers]
    assert preview_window(plain) == preview_window(stock) == 0
    for cache in (plain, stock):
        preview_prompt(model, cache, mx.arange(40) % VOCAB)
    assert all(c.preview is None for c in plain)
    short = make_h2o_cache(model, H2OConfig(max_size=16, prefill_compact="preview"))
    preview_prompt(model, short, mx.arange(20) % VOCAB)  # no longer than the window
    assert all(c.preview is None for c in short)


def test_preview_prompt_refuses_bad_input():
    model = tiny_llama()
    cache = make_h2o_cache(model, H2OConfig(max_size=16, prefill_compact="preview"))
    with pytest.raises(ValueError, match=r"\(L,\) or \(B, L\)"):
        preview_prompt(model, cache, mx.zeros((1, 1, 40), mx.int32))


def test_a_continued_prompt_is_previewed_after_what_the_cache_holds():
    model = tiny_llama()
    cache = make_h2o_cache(model, H2OConfig(max_size=16, prefill_window=8,
                                            prefill_compact="preview"))
    with mlx_h2o.patch():
        model(mx.arange(5)[None], cache=cache)
    preview_prompt(model, cache, mx.arange(40) % VOCAB)
    assert all(c.preview_from == 5 + 40 - 8 for c in cache)


def test_a_prompt_of_one_prefill_chunk_is_not_previewed():
    model = tiny_llama()
    for L, step, previewed in [(41, 40, False), (42, 40, True), (42, None, True)]:
        cache = make_h2o_cache(model, H2OConfig(max_size=16, prefill_window=8,
                                                prefill_compact="preview"))
        preview_prompt(model, cache, mx.arange(L) % VOCAB, step)
        assert all((c.preview is not None) is previewed for c in cache)


def _logits(model, cache, tokens, step):
    with mlx_h2o.patch():
        for s in range(0, tokens.shape[1] - 1, step):
            model(tokens[:, s:min(s + step, tokens.shape[1] - 1)], cache=cache)
        return model(tokens[:, -1:], cache=cache)


@pytest.mark.parametrize("arch,compact", [("llama", "preview"), ("gemma3_text", "preview"),
                                          ("llama", "two_pass"), ("gemma3_text", "two_pass")])
def test_within_the_budget_preview_is_the_full_cache(arch, compact):
    model = BUILDERS[arch]()
    tokens = mx.random.randint(0, VOCAB, (2, 60), key=mx.random.key(2))
    cache = make_h2o_cache(model, H2OConfig(max_size=64, prefill_window=8,
                                            prefill_compact=compact))
    preview_prompt(model, cache, tokens)
    assert any(c.preview is not None for c in cache)
    got = _logits(model, cache, tokens, 16)
    want = _logits(model, [KVCache() for _ in model.layers], tokens, 16)
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-4, atol=1e-4)


def test_generate_previews_a_long_prompt(monkeypatch):
    from mlx_h2o.integration import generate as gen

    model, calls = tiny_llama(), []
    real = gen.preview_prompt

    def spy(m, cache, prompt, step):
        calls.append((len(cache), prompt.shape, step))
        real(m, cache, prompt, step)
        assert all(c.preview is not None for c in cache)

    monkeypatch.setattr(gen, "preview_prompt", spy)
    tok, prompt = word_tokenizer(), " ".join(f"w{i % 40 + 2}" for i in range(160))
    text = mlx_h2o.generate(model, tok, prompt, max_tokens=3, prefill_step_size=48,
                            h2o_config=H2OConfig(max_size=32))  # the default previews
    assert calls == [(len(model.layers), (160,), 48)] and isinstance(text, str)
    mlx_h2o.generate(model, tok, prompt, max_tokens=3, prefill_step_size=48,
                     h2o_config=H2OConfig(max_size=32, prefill_compact="chunk"))
    assert len(calls) == 1  # "chunk": nothing previewed


@pytest.mark.parametrize("compact", ["preview", "two_pass"])
def test_config_and_cli_take_the_preview_mode(compact):
    cfg = H2OConfig(max_size=16, prefill_compact=compact)
    assert config_to_dict(cfg)["prefill_compact"] == compact
    assert config_from_dict(config_to_dict(cfg)) == cfg
    with pytest.raises(ValueError, match="prefill_compact"):
        H2OConfig(max_size=16, prefill_compact="previews")


def test_a_trim_forgets_the_preview():
    model = tiny_llama()
    cache = make_h2o_cache(model, H2OConfig(max_size=16, prefill_window=8))
    preview_prompt(model, cache, mx.arange(60) % VOCAB)
    with mlx_h2o.patch():
        model(mx.arange(20)[None] % VOCAB, cache=cache)  # a first chunk, then trimmed away
    assert all(c.preview is not None for c in cache)
    for c in cache:
        c.trim(5)
    assert all(c.preview is None for c in cache)


# --- batch rows (the server) ------------------------------------------------------------
def _previewed_singles(model, config, prompts, step):
    singles = [make_h2o_cache(model, config, layer_budget="uniform") for _ in prompts]
    for cache, p in zip(singles, prompts):
        preview_prompt(model, cache, p, step)
    return singles


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
@pytest.mark.parametrize("score", ["accumulated", "normalized"])
def test_previewed_rows_hold_what_previewed_single_caches_hold(arch, score):
    from test_batch_cache import (batch_decode, batch_prefill, check_invariants as rows_ok,
                                  held, rows_held)

    model, chunk_len = BUILDERS[arch](), 9
    config = H2OConfig(max_size=12, sink_size=2, heavy_budget=6, prefill_window=4,
                       prefill_pool=3, score=score)
    prompts = [np.random.default_rng(b).integers(2, VOCAB, n).tolist()
               for b, n in enumerate((3, 31, 19, 40))]
    singles = _previewed_singles(model, config, prompts, chunk_len)
    assert [any(c.preview is not None for c in s) for s in singles] == [False, True, True, True]
    batch = [mlx_h2o.cache.batch_cache.BatchH2OKVCache.merge(list(layer))
             for layer in zip(*singles)]
    L = max(len(p) for p in prompts)
    tokens = mx.array([p + [0] * (L - len(p)) for p in prompts])
    with mlx_h2o.patch():
        for c in batch:
            c.prepare(lengths=[len(p) for p in prompts],
                      right_padding=[L - len(p) for p in prompts])
        for s in range(0, L, chunk_len):
            model(tokens[:, s:s + chunk_len], cache=batch)
        for c in batch:
            c.finalize()
    assert all(p is None for c in batch for p in c.previews)  # every end has arrived
    rows_ok(batch)
    batch_decode(model, batch, [[5, 6, 7]] * len(prompts))
    for b, p in enumerate(prompts):
        ref = _previewed_singles(model, config, [p], chunk_len)[0]
        with mlx_h2o.patch():
            for s in range(0, len(p), chunk_len):
                model(mx.array([p[s:s + chunk_len]]), cache=ref)
            for t in (5, 6, 7):
                model(mx.array([[t]]), cache=ref)
        assert rows_held(batch, len(prompts))[b] == held(ref), f"row {b}"
    # Without previews the rows keep other tokens: the comparison can fail.
    plain = batch_prefill(model, config, prompts, chunk_len)
    batch_decode(model, plain, [[5, 6, 7]] * len(prompts))
    assert rows_held(plain, len(prompts)) != rows_held(batch, len(prompts))


def test_rows_carry_their_previews_through_filter_extend_and_extract():
    from mlx_h2o.cache.batch_cache import BatchH2OKVCache

    model = tiny_llama()
    config = H2OConfig(max_size=12, sink_size=2, heavy_budget=6, prefill_window=4)
    prompts = [list(range(2, 2 + n)) for n in (30, 3, 25)]
    singles = _previewed_singles(model, config, prompts, None)
    batch = BatchH2OKVCache.merge([s[0] for s in singles])
    starts = [None if p is None else p[1] for p in batch.previews]
    assert starts == [26, None, 21]
    batch.filter([2, 0])
    assert [p[1] for p in batch.previews] == [21, 26]
    batch.extend(BatchH2OKVCache.merge([singles[1][0]]))
    assert [None if p is None else p[1] for p in batch.previews] == [21, 26, None]
    out = batch.extract(1)
    assert out.preview_from == 26 and out.preview.shape == singles[0][0].preview.shape
    batch.trim(0)
    assert batch.previews == [None] * 3


def test_the_server_previews_each_prompt_before_its_batch():
    from mlx_h2o.integration.serve import StatsTracker, _batch_generator
    from mlx_h2o.integration.serving import use_h2o_caches

    model, step = tiny_llama(), 8
    config = H2OConfig(max_size=12, sink_size=2, heavy_budget=6, prefill_window=4)
    # Seeded prompts whose previews change what a row keeps (checked below).
    prompts = [np.random.default_rng(2 + b).integers(2, VOCAB, n).tolist()
               for b, n in enumerate((26, 5, 33))]
    results = {}
    with use_h2o_caches(config):
        gen = _batch_generator(StatsTracker())(model, prefill_step_size=step,
                                               completion_batch_size=3, prefill_batch_size=3)
        uids = gen.insert(prompts, [4, 4, 4])
        pending = list(gen._unprocessed_sequences)
        assert [e[3][0].preview is not None for e in pending] == [True, False, True]
        for _ in range(100):
            for r in gen.next()[1]:
                if r.finish_reason is not None:
                    results[r.uid] = (r.all_tokens, r.prompt_cache)
            if len(results) == len(prompts):
                break
        gen.close()
    from test_batch_cache import held

    def single(p, tokens, preview):
        ref = (_previewed_singles(model, config, [p], step)[0] if preview else
               make_h2o_cache(model, config, layer_budget="uniform"))
        with mlx_h2o.patch():
            for s in range(0, len(p) - 1, step):
                model(mx.array([p[s:min(s + step, len(p) - 1)]]), cache=ref)
            for t in tokens[len(p) - 1:]:
                model(mx.array([[t]]), cache=ref)
        return held(ref)

    differ = False
    for uid, p in zip(uids, prompts):
        tokens, cache = results[uid]
        assert held(cache) == single(p, tokens, True), f"uid {uid}"
        differ |= held(cache) != single(p, tokens, False)
    assert differ  # the previews changed what was kept: the comparison can fail


def test_the_servers_one_at_a_time_path_previews_too():
    from mlx_h2o.integration.serve import StatsTracker, _stream_generate

    model = tiny_llama()
    cache = make_h2o_cache(model, H2OConfig(max_size=12, prefill_window=4))
    seen = []

    def stream_generate(**kwargs):  # mlx-lm's, as the server calls it
        seen.append([c.preview_from if c.preview is not None else None
                     for c in kwargs["prompt_cache"]])
        yield from ()

    tracked = _stream_generate(StatsTracker(), stream_generate)
    list(tracked(model=model, tokenizer=None, prompt=list(range(2, 40)),
                 prompt_cache=cache, prefill_step_size=8))
    assert seen == [[34] * len(cache)]
    short = make_h2o_cache(model, H2OConfig(max_size=12, prefill_window=4))
    list(tracked(model=model, tokenizer=None, prompt=list(range(2, 11)), prompt_cache=short,
                 prefill_step_size=8))  # one prefill chunk: nothing to preview
    assert seen[-1] == [None] * len(short)


@pytest.mark.parametrize("bits", [8, 4])
def test_a_quantized_cache_scores_its_preview_through_its_own_attention(bits):
    from mlx_h2o.cache import QuantConfig, QuantizedH2OKVCache

    cfg = H2OConfig(**{**CFG, "max_size": 64, "prefill_compact": "preview"})
    cache = QuantizedH2OKVCache(cfg, quant=QuantConfig(bits, 32))
    rng = np.random.default_rng(bits)
    k, v = (mx.array(rng.standard_normal((1, 1, 40, 32)).astype(np.float32)) for _ in "kv")
    keys, values = cache.update_and_fetch(k, v)
    q = mx.array(rng.standard_normal((1, 2, 4, 32)).astype(np.float32))
    zero = (mx.zeros((1, 1, 40)), mx.zeros((1, 1, 40)))
    got = chunk.with_preview(cache.kv, "accumulated", 1, zero, q, keys, values, 32 ** -0.5,
                             None)
    dense = cache.kv.dense(keys, values, mx.float32)
    want = chunk.with_preview(DenseKV(), "accumulated", 1, zero, q, *dense, 32 ** -0.5, None)
    # The storage's attention reads the codes the dequantized copy was made from.
    np.testing.assert_allclose(np.array(got[0]), np.array(want[0]), rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(np.array(got[1]), np.array(want[1]))


def _end_queries_of_a_stepped_prefill(model, cache, tokens, W, step, monkeypatch):
    """Each layer's queries of the last W tokens when ``tokens`` is fed to
    ``cache`` in chunks of ``step`` with those W as a call of their own."""
    seen, original = {}, H2OKVCache.h2o_attention

    def spy(self, queries, keys, values, **kwargs):
        seen[id(self)] = queries
        return original(self, queries, keys, values, **kwargs)

    L = tokens.shape[1]
    with monkeypatch.context() as m, mlx_h2o.patch():
        m.setattr(H2OKVCache, "h2o_attention", spy)
        for s in range(0, L - W, step):
            model(tokens[:, s:min(s + step, L - W)], cache=cache)
        model(tokens[:, L - W:], cache=cache)
    return [seen[id(c)] for c in cache]


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_two_pass_previews_the_ends_queries_from_a_bounded_prefill(arch, monkeypatch):
    monkeypatch.setattr(mlx_h2o.integration.preview, "PREVIEW_TOKENS", 20)
    model = BUILDERS[arch]()
    L, W, step = 70, 8, 24
    tokens = mx.random.randint(0, VOCAB, (2, L), key=mx.random.key(3))
    config = H2OConfig(max_size=16, prefill_window=W, prefill_compact="two_pass")
    cache = make_h2o_cache(model, config)
    preview_prompt(model, cache, tokens, step)
    # The first pass, by hand: fresh caches read ahead ("preview" reads the
    # same), fed in steps, the end's queries recorded at the attention.
    by_hand = make_h2o_cache(model, dataclasses.replace(config, prefill_compact="preview"))
    preview_prompt(model, by_hand, tokens)
    want = _end_queries_of_a_stepped_prefill(model, by_hand, tokens, W, step, monkeypatch)
    assert any(c.wants_preview() for c in cache)
    for c, q in zip(cache, want):
        if not c.wants_preview():
            assert c.preview is None
            continue
        assert c.preview_from == L - W and c.offset == 0
        np.testing.assert_allclose(np.array(c.preview), np.array(q[:, :, -W:]),
                                   rtol=1e-4, atol=1e-4)


def test_the_first_pass_leaves_the_caches_as_they_were():
    model = tiny_llama()
    cache = make_h2o_cache(model, H2OConfig(max_size=16, prefill_window=8,
                                            prefill_compact="two_pass"))
    with mlx_h2o.patch():
        model(mx.random.randint(0, VOCAB, (1, 30), key=mx.random.key(4)), cache=cache)
    before = [(c.offset, [np.array(a) for a in c.state]) for c in cache]
    preview_prompt(model, cache, mx.arange(60) % VOCAB, 16)
    for c, (offset, state) in zip(cache, before):
        assert c.offset == offset and c.preview_from == offset + 60 - 8
        for a, b in zip(c.state, state):
            np.testing.assert_array_equal(np.array(a), b)
