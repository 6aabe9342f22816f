"""BatchH2OKVCache: mlx-lm's batch cache contract with H2O eviction per row.

The reference for every row is an H2OKVCache fed that row alone (the same
chunks, the same tokens): the batch must keep, per layer and KV head, the
same token positions. Within the budget, mlx-lm's BatchGenerator must
produce BatchKVCache's tokens.
"""

import copy

import mlx.core as mx
import mlx_lm
import numpy as np
import pytest
from mlx_lm.generate import BatchGenerator

import mlx_h2o
from mlx_h2o import H2OConfig, H2OKVCache, make_h2o_cache
from mlx_h2o.cache.batch_cache import BatchH2OKVCache
from mlx_h2o.cache.quantized import QuantConfig, quantized_cache_type
from mlx_h2o.integration.serving import use_h2o_caches
from test_integration import word_tokenizer
from tiny_models import BUILDERS, VOCAB, tiny_llama

pytestmark = pytest.mark.usefixtures("on_cpu")


# --- references ------------------------------------------------------------------
def single_run(model, config, tokens, chunk, decode=(), kind="auto"):
    """An H2OKVCache per layer fed ``tokens`` in chunks of ``chunk``, then the
    ``decode`` tokens one by one (one sequence), taking the decode step ``kind``."""
    cache = make_h2o_cache(model, config, layer_budget="uniform", decode=kind)
    with mlx_h2o.patch():
        for s in range(0, len(tokens), chunk):
            model(mx.array([tokens[s : s + chunk]]), cache=cache)
        for t in decode:
            model(mx.array([[t]]), cache=cache)
    return cache


def held(cache):
    """Per layer, per KV head: the sorted positions a single cache holds."""
    out = []
    for c in cache:
        pos = np.array(c.positions[0, :, : c.size()])
        out.append([sorted(p.tolist()) for p in pos])
    return out


def batch_prefill(model, config, prompts, chunk):
    """One batch cache per layer (merged from fresh H2OKVCaches), prompts
    right-padded and fed in chunks of ``chunk``, as PromptProcessingBatch does."""
    singles = [make_h2o_cache(model, config, layer_budget="uniform") for _ in prompts]
    batch = [BatchH2OKVCache.merge(list(layer)) for layer in zip(*singles)]
    lengths = [len(p) for p in prompts]
    L = max(lengths)
    tokens = mx.array([p + [0] * (L - len(p)) for p in prompts])
    with mlx_h2o.patch():
        for c in batch:
            c.prepare(lengths=lengths, right_padding=[L - n for n in lengths])
        for s in range(0, L, chunk):
            model(tokens[:, s : s + chunk], cache=batch)
        for c in batch:
            c.finalize()
    return batch


def batch_decode(model, batch, columns):
    """Feed one token per row per step; ``columns``: (B, steps) tokens. Each
    step moves every row's offset on by one."""
    with mlx_h2o.patch():
        for t in range(len(columns[0])):
            before = [c.offset.tolist() for c in batch]
            model(mx.array([[row[t]] for row in columns]), cache=batch)
            assert all(c.offset.tolist() == [o + 1 for o in b] for c, b in zip(batch, before))


def rows_held(batch, B):
    return [held([c.extract(b) for c in batch]) for b in range(B)]


def random_prompts(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(2, VOCAB, n).tolist() for n in lengths]


def check_invariants(batch):
    for c in batch:
        cfg = c.config
        assert c.size() <= max(cfg.max_size, max(c.kept))
        pos = np.array(c.positions[..., : c.size()])
        for b, (seen, kept) in enumerate(zip(c.seen, c.kept)):
            assert c.offset[b].item() == seen and kept <= seen
            for head in pos[b]:
                mine = head[head >= 0]
                assert len(mine) == kept and len(set(mine.tolist())) == kept
                assert mine.max() < seen
                want = set(range(max(0, seen - cfg.recent_budget), seen))
                if c.window_size is None:  # a sliding window drops what it cannot see
                    want |= set(range(min(cfg.sink_size, seen)))
                    want |= {p for a, e in cfg.pinned for p in range(a, e) if p < seen}
                assert want <= set(mine.tolist())


# --- within the budget: mlx-lm's own batch cache ---------------------------------------
@pytest.mark.parametrize("arch", sorted(BUILDERS))
def test_batch_generate_matches_batch_kv_cache_within_budget(arch):
    model, tok = BUILDERS[arch](), word_tokenizer()
    prompts = random_prompts((5, 23, 11, 2), seed=1)
    kw = dict(max_tokens=10, return_token_ids=True, prefill_step_size=8)
    ref = mlx_lm.batch_generate(model, tok, prompts, **kw)
    merge_before = vars(H2OKVCache).get("merge")
    with use_h2o_caches(H2OConfig(max_size=64)):
        out = mlx_lm.batch_generate(model, tok, prompts, return_prompt_caches=True, **kw)
    assert out.token_ids == ref.token_ids
    assert all(type(c) is H2OKVCache and c.evicted == 0 for row in out.caches for c in row)
    assert not mlx_h2o.is_enabled() and vars(H2OKVCache).get("merge") is merge_before


# --- eviction: every row as if alone ------------------------------------------------
CONFIGS = {
    "accumulated": H2OConfig(max_size=12, sink_size=2, heavy_budget=6),
    "normalized": H2OConfig(max_size=12, sink_size=2, heavy_budget=6, score="normalized"),
    "ema": H2OConfig(max_size=10, sink_size=1, heavy_budget=5, score="ema"),
    "prompt": H2OConfig(max_size=12, sink_size=2, prefill_compact="prompt",
                        prefill_window=4),
    # Chunks of 9 past the budget: a later one's window replaces the scores.
    "window": H2OConfig(max_size=12, sink_size=2, heavy_budget=6, prefill_window=4,
                        prefill_pool=3),
    "pinned": H2OConfig(max_size=12, sink_size=2, heavy_budget=6, pinned=((5, 7),)),
    "key_norm": H2OConfig(max_size=12, sink_size=2, heavy_budget=6, score="key_norm"),
    "expected_attention": H2OConfig(max_size=12, sink_size=2, heavy_budget=6,
                                    score="expected_attention", prefill_window=4),
}


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_rows_hold_what_a_single_cache_holds(arch, name):
    config, chunk = CONFIGS[name], 9
    model = BUILDERS[arch]()
    prompts = random_prompts((3, 30, 19, 10), seed=2)
    decode = random_prompts((8,) * len(prompts), seed=3)
    batch = batch_prefill(model, config, prompts, chunk)
    check_invariants(batch)
    batch_decode(model, batch, decode)
    check_invariants(batch)
    for b, (p, d) in enumerate(zip(prompts, decode)):
        want = held(single_run(model, config, p, chunk, d))
        assert rows_held(batch, len(prompts))[b] == want, f"row {b}"


def test_left_padded_rows_hold_what_a_single_cache_holds():
    model, config = BUILDERS["gemma3_text"](), CONFIGS["accumulated"]
    prompts = random_prompts((20, 7, 13), seed=16)
    pads = [20 - len(p) for p in prompts]
    batch = [BatchH2OKVCache(c.config, 3, c.window_size, left_padding=pads)
             for c in make_h2o_cache(model, config, layer_budget="uniform")]
    assert batch[0].offset.tolist() == [0, -13, -7]  # RoPE: each row's tokens from 0
    with mlx_h2o.patch():
        model(mx.array([[0] * n + p for n, p in zip(pads, prompts)]), cache=batch)
    assert batch[0].offset.tolist() == [20, 7, 13] and batch[0].kept == [12, 7, 12]
    decode = random_prompts((5,) * 3, seed=17)
    batch_decode(model, batch, decode)
    check_invariants(batch)
    for b, (p, d) in enumerate(zip(prompts, decode)):
        assert rows_held(batch, 3)[b] == held(single_run(model, config, p, 20, d))


def test_decode_logits_match_single_caches_while_evicting():
    model, config = tiny_llama(), CONFIGS["accumulated"]
    prompts = random_prompts((17, 6), seed=4)
    batch = batch_prefill(model, config, prompts, 8)
    singles = [single_run(model, config, p, 8) for p in prompts]
    with mlx_h2o.patch():
        for t in random_prompts((6,), seed=5)[0]:
            out = model(mx.array([[t], [t]]), cache=batch)
            ref = [model(mx.array([[t]]), cache=s) for s in singles]
            np.testing.assert_allclose(np.array(out), np.array(mx.concatenate(ref)),
                                       atol=1e-4, rtol=1e-4)


# --- rows joining and leaving, extract, trim, state ---------------------------------------
def test_rows_join_and_leave_under_batch_generator():
    """BatchGenerator with rows of different lengths (some beyond the budget)
    joining while others decode and leaving when done: each finished row's
    cache holds what a single cache fed its tokens holds."""
    model, config, step = tiny_llama(), CONFIGS["accumulated"], 8
    prompts = random_prompts((4, 26, 15, 9, 33), seed=6)
    budgets = [3, 12, 5, 9, 7]
    results = {}
    with use_h2o_caches(config):
        gen = BatchGenerator(model, prefill_step_size=step, completion_batch_size=3,
                             prefill_batch_size=2)
        uids = gen.insert(prompts[:3], budgets[:3])
        for steps in range(200):
            if steps == 4:  # two more join while the first decode
                uids += gen.insert(prompts[3:], budgets[3:])
            _, responses = gen.next()
            for r in responses:
                if r.finish_reason is not None:
                    results[r.uid] = (r.all_tokens, r.prompt_cache)
            if len(results) == len(prompts):
                break
        gen.close()
    assert len(results) == len(prompts)
    for uid, p in zip(uids, prompts):
        tokens, cache = results[uid]
        assert tokens[: len(p)] == p and all(c.offset == len(tokens) for c in cache)
        want = single_run(model, config, p[:-1], step, tokens[len(p) - 1 :])
        assert held(cache) == held(want), f"uid {uid}"


def test_extract_continues_as_the_batch_row():
    model, config = tiny_llama(), CONFIGS["normalized"]
    prompts = random_prompts((21, 7, 14), seed=7)
    batch = batch_prefill(model, config, prompts, 8)
    batch_decode(model, batch, random_prompts((3,) * 3, seed=8))
    single = [c.extract(1) for c in batch]
    assert all(type(c) is H2OKVCache and c.offset == 10 for c in single)
    more = random_prompts((9,), seed=9)[0]
    with mlx_h2o.patch():
        for t in more:
            out = model(mx.array([[t]] * 3), cache=batch)
            ref = model(mx.array([[t]]), cache=single)
            np.testing.assert_allclose(np.array(out[1]), np.array(ref[0]),
                                       atol=1e-4, rtol=1e-4)
    assert held(single) == rows_held(batch, 3)[1]


def test_extend_and_filter_keep_each_rows_tokens():
    model, config = tiny_llama(), CONFIGS["accumulated"]
    a = batch_prefill(model, config, random_prompts((20, 5), seed=10), 8)
    b = batch_prefill(model, config, random_prompts((3, 16), seed=11), 8)
    before = rows_held(a, 2) + rows_held(b, 2)
    for x, y in zip(a, b):
        x.extend(y)
    assert rows_held(a, 4) == before and a[0].seen == [20, 5, 3, 16]
    for x in a:
        x.filter([3, 1])
    assert rows_held(a, 2) == [before[3], before[1]] and a[0].size() <= 12
    check_invariants(a)


def test_trim_forgets_the_newest_tokens_of_every_row_exactly():
    model, config = tiny_llama(), CONFIGS["accumulated"]
    prompts = random_prompts((18, 9), seed=12)
    decode = random_prompts((5, 5), seed=13)
    batch = batch_prefill(model, config, prompts, 8)
    batch_decode(model, batch, decode)
    assert all(c.trim(4) == 4 for c in batch) and batch[0].seen == [19, 10]
    for b, (p, d) in enumerate(zip(prompts, decode)):
        single = single_run(model, config, p, 8, d)
        assert all(c.trim(4) == 4 for c in single)
        assert rows_held(batch, 2)[b] == held(single)
    assert batch[0].trim(100) == 10 and batch[0].seen == [9, 0]


def test_state_round_trip_and_deepcopy():
    model, config = tiny_llama(), CONFIGS["ema"]
    batch = batch_prefill(model, config, random_prompts((15, 4), seed=14), 8)
    copies = [copy.deepcopy(c) for c in batch]
    loaded = [BatchH2OKVCache.from_state(c.state, c.meta_state) for c in batch]
    col = random_prompts((4, 4), seed=15)
    for caches in (batch, copies, loaded):
        batch_decode(model, caches, col)
    assert rows_held(copies, 2) == rows_held(batch, 2) == rows_held(loaded, 2)
    assert copies[0].kv.keys is not batch[0].kv.keys and batch[0].nbytes > 0
    # After decode steps (mlx-lm copies a prompt batch when it splits one)
    later = [copy.deepcopy(c) for c in batch]
    more = random_prompts((3, 3), seed=18)
    for caches in (batch, later):
        batch_decode(model, caches, more)
    assert rows_held(later, 2) == rows_held(batch, 2)


def test_batch_generate_takes_h2o_prompt_caches():
    """mlx-lm's batch_generate with one H2O prompt cache per prompt (H2OKVCache
    has mlx-lm's merge): within the budget, BatchKVCache's tokens."""
    model, tok = tiny_llama(), word_tokenizer()
    prompts = random_prompts((7, 3, 12), seed=4)
    kw = dict(max_tokens=8, return_token_ids=True)
    ref = mlx_lm.batch_generate(model, tok, prompts, **kw)
    caches = [make_h2o_cache(model, H2OConfig(max_size=64)) for _ in prompts]
    with mlx_h2o.patch():
        out = mlx_lm.batch_generate(model, tok, prompts, prompt_caches=caches, **kw)
    assert out.token_ids == ref.token_ids


def test_merge_refuses_what_it_cannot_batch():
    model = tiny_llama()
    config = H2OConfig(max_size=16)
    dense = make_h2o_cache(model, config)
    quant = make_h2o_cache(model, config, quantized_cache_type(QuantConfig(bits=8)))
    with pytest.raises(ValueError, match="dense H2OKVCache"):
        BatchH2OKVCache.merge([dense[0], quant[0]])
    other = make_h2o_cache(model, H2OConfig(max_size=32))
    with pytest.raises(ValueError, match="different budgets"):
        BatchH2OKVCache.merge([dense[0], other[0]])
    with pytest.raises(ValueError, match="evict_batch"):
        BatchH2OKVCache(H2OConfig(max_size=32, evict_batch=4), 2)


def test_shared_row_arrays_serve_any_thread():
    """The per-row arrays every layer shares are cached across calls; a
    server's generation thread may read one another thread made (a lazy
    array is bound to the stream of the thread that made it)."""
    import threading

    from mlx_h2o.cache.batch_rows import row_ints

    made = row_ints((7, 9, 11), 3)  # made here, not evaluated here
    errors = []

    def read():
        try:
            mx.eval(made + 1)
        except RuntimeError as e:
            errors.append(str(e))

    worker = threading.Thread(target=read)
    worker.start()
    worker.join(30)
    assert errors == []
