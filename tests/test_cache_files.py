"""Cache files: checksum, structure and consistency checks, checks against the
model, file mode. Each bad file must be refused with a ValueError naming the
problem and the fix."""

import json
import os

import mlx.core as mx
import numpy as np
import pytest
from tiny_models import VOCAB, teacher_forced, tiny_gemma3, tiny_llama

from mlx_h2o import H2OConfig, H2OKVCache, make_h2o_cache
from mlx_h2o.cache import (
    QuantConfig,
    quantized_cache_type,
)
from mlx_h2o.files import load_prompt_cache, save_prompt_cache
from mlx_h2o.files.io import checksum

D, HQ, HK = 8, 4, 2
CFG = H2OConfig(max_size=10, sink_size=2, heavy_budget=4)


def step(cache, L, rng, B=2):
    q, k, v = (
        mx.array(rng.standard_normal((B, h, L, D)).astype(np.float32))
        for h in (HQ, HK, HK)
    )
    mask = cache.make_mask(L)
    keys, values = cache.update_and_fetch(k * 3, v)
    return cache.h2o_attention(q, keys, values, scale=1.0, mask=mask)


def saved(tmp_path, cfg=CFG, lengths=(15, 1, 1, 1), cache_type=H2OKVCache, name="c"):
    """A file of two evicting layers (one full attention, one window 6)."""
    rng, cache = (
        np.random.default_rng(4),
        [cache_type(cfg), cache_type(cfg, window_size=6)],
    )
    for L in lengths:
        for c in cache:
            step(c, L, rng)
    path = str(tmp_path / f"{name}.safetensors")
    save_prompt_cache(path, cache, {"model": "test"})
    return path, cache


def edit(path, change, resign=True):
    """Rewrite ``path`` with ``change(arrays, header, metas)`` applied; re-signed,
    the checksum passes and the other checks must catch the edit."""
    arrays, header = mx.load(path, return_metadata=True)
    mx.eval(list(arrays.values()))
    metas = json.loads(header["meta_states"])
    change(arrays, header, metas)
    header["meta_states"] = json.dumps(metas)
    if resign:
        header["checksum"] = checksum(arrays, header)
    mx.save_safetensors(path, arrays, header)


def refused(path, match, **kw):
    with pytest.raises(ValueError, match=match) as info:
        load_prompt_cache(path, **kw)
    assert str(path) in str(info.value)
    return str(info.value)


def same_caches(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert (x.offset, x.evicted, x.config, x.size(), x.window_size) == (
            y.offset,
            y.evicted,
            y.config,
            y.size(),
            y.window_size,
        )
        for s, t in zip(x.state, y.state):
            np.testing.assert_array_equal(np.array(s), np.array(t))


# --- file mode, checksum --------------------------------------------------------------
@pytest.mark.parametrize("umask,mode", [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_file_mode_follows_the_umask(tmp_path, umask, mode):
    old = os.umask(umask)
    try:
        path, _ = saved(tmp_path)
    finally:
        os.umask(old)
    assert os.stat(path).st_mode & 0o777 == mode
    assert not list(tmp_path.glob(".tmp-*"))


def test_flipped_tensor_bytes_are_refused(tmp_path):
    path, cache = saved(tmp_path)
    same_caches(load_prompt_cache(path), cache)
    raw = bytearray(open(path, "rb").read())
    data = 8 + int.from_bytes(
        raw[:8], "little"
    )  # safetensors: length, JSON header, data
    raw[data + 5] ^= 0x40
    open(path, "wb").write(bytes(raw))
    refused(path, "checksum does not match.*delete it and save the cache again")


def test_edited_header_is_refused_by_the_checksum(tmp_path):
    path, _ = saved(tmp_path)
    edit(path, lambda a, h, m: m[0].__setitem__(0, str(int(m[0][0]) + 1)), resign=False)
    refused(path, "checksum does not match")


def test_file_without_checksum_loads_with_a_warning(tmp_path):
    path, cache = saved(tmp_path)
    edit(path, lambda a, h, m: h.pop("checksum"), resign=False)
    with pytest.warns(UserWarning, match="no checksum"):
        same_caches(load_prompt_cache(path), cache)
    # The other checks still apply to it.
    edit(path, lambda a, h, m: m[1].pop(), resign=False)
    with pytest.warns(UserWarning, match="no checksum"):
        refused(path, "meta state must be 5 strings")


# --- structure and consistency (re-signed edits) --------------------------------------
def _config(metas, i, **changes):
    d = json.loads(metas[i][4])
    d.update(changes)
    metas[i][4] = json.dumps(d)


def _put(arrays, key, fn):
    a = np.array(arrays[key])
    arrays[key] = mx.array(fn(a))


def _dup(p):
    p[..., 1] = p[..., 0]
    return p


def _neg(p):
    p[0, 0, 0] = -1
    return p


def _set_first(a, value):
    a[0, 0, 0] = value
    return a


EDITS = {
    "short meta state": (
        lambda a, h, m: m[0].pop(),
        "layer 0 .*meta state must be 5 strings",
    ),
    "meta state of another class": (
        lambda a, h, m: m[1].append("{}"),
        "must be 5 strings",
    ),
    "max_size below the slots": (
        lambda a, h, m: _config(m, 0, max_size=8, heavy_budget=3, recent_budget=3),
        "holds 10 tokens, above max_size=8",
    ),
    "invalid config": (
        lambda a, h, m: _config(m, 1, max_size=0),
        "invalid window or config",
    ),
    "offset raised": (
        lambda a, h, m: m[0].__setitem__(0, str(int(m[0][0]) + 3)),
        "offset=.* must count the 10 tokens held",
    ),
    "offset lowered": (lambda a, h, m: m[0].__setitem__(0, "9"), "offset=9"),
    "offset not a number": (
        lambda a, h, m: m[0].__setitem__(0, "x"),
        "offset 'x' is not a count",
    ),
    "window 0": (lambda a, h, m: m[1].__setitem__(2, "0"), "window_size"),
    "repeated position": (lambda a, h, m: _put(a, "0.2", _dup), "repeat a token"),
    "negative position": (lambda a, h, m: _put(a, "1.2", _neg), "outside 0.."),
    "float positions": (
        lambda a, h, m: _put(a, "0.2", lambda p: p.astype(np.float32)),
        "int32",
    ),
    "NaN score": (
        lambda a, h, m: _put(a, "0.3", lambda s: _set_first(s, np.nan)),
        "its score holds NaN or infinite values",
    ),
    "infinite count": (
        lambda a, h, m: _put(a, "1.4", lambda c: _set_first(c, np.inf)),
        "its count holds NaN or infinite values",
    ),
    "short score": (
        lambda a, h, m: _put(a, "0.3", lambda s: s[..., :-1]),
        "its score is",
    ),
    "short keys": (
        lambda a, h, m: _put(a, "1.0", lambda k: k[..., :-1, :]),
        r"\(B, n_kv_heads, slots\)",
    ),
    "keys of fewer heads": (
        lambda a, h, m: _put(a, "0.1", lambda v: v[:, :1]),
        r"\(B, n_kv_heads, slots\)",
    ),
    "missing array": (lambda a, h, m: a.pop("1.4"), r"missing \['1.4'\]"),
    "extra array": (
        lambda a, h, m: a.__setitem__("2.0", mx.zeros(3)),
        r"unexpected \['2.0'\]",
    ),
    "fewer classes": (
        lambda a, h, m: h.__setitem__("classes", '["H2OKVCache"]'),
        "1 classes, 2 state lengths and 2 meta states",
    ),
    "unknown class": (
        lambda a, h, m: h.__setitem__("classes", '["Foo", "H2OKVCache"]'),
        "unknown cache class 'Foo'",
    ),
    "header field not JSON": (
        lambda a, h, m: h.__setitem__("lengths", "[5,"),
        "'lengths'",
    ),
}


@pytest.mark.parametrize("name", list(EDITS))
def test_inconsistent_file_is_refused(tmp_path, name):
    change, match = EDITS[name]
    path, _ = saved(tmp_path)
    edit(path, change)
    msg = refused(path, match)
    assert "delete it" in msg or "import the module" in msg or "window_size" in msg


def test_prompt_left_uncompacted_loads_only_under_its_option(tmp_path):
    """prefill_compact="prompt" holds a whole prompt past max_size until the
    first decode step: such a file loads; the same slots under "chunk" do not."""
    cfg = H2OConfig(max_size=10, sink_size=2, heavy_budget=4, prefill_compact="prompt")
    path, cache = saved(tmp_path, cfg, lengths=(15, 1, 12))
    assert cache[0].size() > cfg.max_size
    same_caches(load_prompt_cache(path), cache)
    edit(path, lambda a, h, m: _config(m, 0, prefill_compact="chunk"))
    refused(path, "above max_size=10")


@pytest.mark.parametrize(
    "quant", [QuantConfig(8, 32), QuantConfig(8, 32, recent_bits=4)]
)
def test_quantized_layout_is_checked(tmp_path, quant):
    cfg = H2OConfig(max_size=10, sink_size=2, heavy_budget=4)
    rng = np.random.default_rng(1)
    make = quantized_cache_type(quant)
    cache = [make(cfg), make(cfg, window_size=6)]
    for L in (15, 1, 1):
        for c in cache:
            q, k, v = (
                mx.array(rng.standard_normal((1, h, L, 32)).astype(np.float16))
                for h in (HQ, HK, HK)
            )
            keys, values = c.update_and_fetch(k, v)
            c.h2o_attention(q, keys, values, scale=0.2, mask=c.make_mask(L))
    path = str(tmp_path / "q.safetensors")
    save_prompt_cache(path, cache)
    loaded = load_prompt_cache(path)
    assert [type(c) for c in loaded] == [type(c) for c in cache]
    other = {"bits": 8, "group_size": 32, "recent_bits": None if quant.mixed else 4}
    for change, match in [
        (
            lambda a, h, m: _put(a, "0.1", lambda s: s[..., :-1]),
            "does not hold group_size=32",
        ),
        (
            lambda a, h, m: m[1].__setitem__(5, json.dumps({"bits": 3})),
            "layer 1 .*bits=3",
        ),
        (
            lambda a, h, m: a.__setitem__("1.0", a["1.3"][..., :1, :]),
            r"\(B, n_kv_heads, slots\)",
        ),
        (  # a width of the other class: mixed for a uniform cache, or back
            lambda a, h, m: m[0].__setitem__(5, json.dumps(other)),
            "does not fit a",
        ),
    ]:
        save_prompt_cache(path, cache)
        edit(path, change)
        refused(path, match)


# --- against the model ----------------------------------------------------------------
def model_file(tmp_path, model, name="m", cache_type=H2OKVCache):
    cache = make_h2o_cache(
        model, H2OConfig(max_size=12, sink_size=2), cache_type, layer_budget="uniform"
    )
    tokens = mx.array(np.random.default_rng(3).integers(0, VOCAB, (1, 20)))
    teacher_forced(model, cache, tokens, prefill=14)
    path = str(tmp_path / f"{name}.safetensors")
    save_prompt_cache(path, cache)
    return path, cache


def test_file_of_the_model_loads(tmp_path):
    model, draft = tiny_gemma3(), tiny_llama()
    path, cache = model_file(tmp_path, model)
    same_caches(load_prompt_cache(path, model=model), cache)
    # A model and its draft: their caches one after the other (mlx-lm's generate).
    both = make_h2o_cache(
        model, H2OConfig(max_size=8), layer_budget="uniform"
    ) + make_h2o_cache(draft, H2OConfig(max_size=8), layer_budget="uniform")
    save_prompt_cache(path, both)
    assert len(load_prompt_cache(path, model=[model, draft])) == 5
    refused(path, "holds 5 layers, the model has 3", model=model)
    wide = tiny_llama(head_dim=64)
    qpath, _ = model_file(tmp_path, wide, "q", quantized_cache_type(QuantConfig(4, 32)))
    load_prompt_cache(qpath, model=wide)  # head dims read from the quantized triples
    refused(
        qpath, r"\(2, 64, 64\), the model's layer 0 makes \(2, 16, 16\)", model=draft
    )


def test_file_of_fewer_layers_is_refused(tmp_path):
    path, _ = model_file(tmp_path, tiny_llama(num_hidden_layers=2))
    msg = refused(
        path, "holds 2 layers, the model has 3", model=tiny_llama(num_hidden_layers=3)
    )
    assert "saved from another model; delete it or pass the matching --model" in msg


def test_file_of_other_layer_kinds_is_refused(tmp_path):
    path, _ = model_file(tmp_path, tiny_gemma3())  # local (window 16) and global layers
    refused(
        path,
        r"layer 0 is an H2O cache \(window 16\), the model's layer 0 takes an H2O "
        r"cache \(full attention\) or KVCache",
        model=tiny_llama(num_hidden_layers=3),
    )


@pytest.mark.parametrize("other", [dict(num_key_value_heads=1), dict(head_dim=32)])
def test_file_of_other_heads_is_refused(tmp_path, other):
    path, _ = model_file(tmp_path, tiny_llama())
    refused(
        path,
        r"layer 0 holds \(n_kv_heads, key dim, value dim\) = \(2, 16, 16\)",
        model=tiny_llama(**other),
    )
