"""Layer profiles: shipped files, "auto" resolution, bad files, calibrate, memory, round trip."""

import json
import os
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

import mlx_h2o
from mlx_h2o import H2OConfig, make_h2o_cache
from mlx_h2o.budgets import layer_sizes
from mlx_h2o.files import load_prompt_cache, save_prompt_cache
from mlx_h2o.integration.factory import attention_windows, resolve_layer_profile
from mlx_h2o.models import PACKAGED_MODELS
from mlx_h2o.profiles import (
    FORMAT,
    PACKAGED_ATTR,
    LayerProfile,
    load_profile,
    save_profile,
    shipped_profile,
)
from tiny_models import VOCAB, teacher_forced as run, tiny_gemma3, tiny_llama


def profile_for(model, weights, **kw) -> LayerProfile:
    windows = attention_windows(model)
    return LayerProfile(statistic="invtopk", weights=tuple(weights),
                        attention_layers=len(windows), windows=windows,
                        model_type=model.args.model_type, **kw)


def as_packaged(model, name, weights, tmp_path, monkeypatch):
    """``model`` posing as packaged ``name`` with a profile of ``weights`` shipped."""
    save_profile(profile_for(model, weights), tmp_path / f"{name}.json")
    monkeypatch.setattr("mlx_h2o.integration.factory.shipped_profile",
                        lambda n: load_profile(tmp_path / f"{n}.json"))
    setattr(model, PACKAGED_ATTR, name)
    return model


# --- shipped profiles ---------------------------------------------------------


@pytest.mark.parametrize("name", sorted(PACKAGED_MODELS))
def test_every_packaged_model_ships_a_valid_profile(name):
    p = shipped_profile(name)
    assert p is not None and p.model == name and p.statistic == "invtopk"
    assert len(p.weights) == p.attention_layers == len(p.windows)
    assert p.calibration == {"corpus": "austen", "num_samples": 4, "seq_len": 512,
                             "seed": 1234}
    assert p.made_by["command"].startswith(f"mlx-h2o calibrate --model {name}")
    assert {"mlx", "mlx_lm"} <= p.made_by.keys()
    assert shipped_profile("no-such-model") is None


@pytest.mark.real_model
@pytest.mark.parametrize("name", sorted(PACKAGED_MODELS))
def test_shipped_profile_fits_the_packaged_model(name):
    # The architecture from the prepared config.json; weights are never loaded
    # (mlx initialises lazily), so this costs no forward pass.
    from mlx_lm.utils import _get_classes

    from mlx_h2o.models import prepare_model

    config = json.loads((prepare_model(name) / "config.json").read_text())
    model_cls, args_cls = _get_classes(config)
    model = model_cls(args_cls.from_dict(config))
    p = shipped_profile(name)
    p.check_model(config["model_type"], attention_windows(model))
    assert p.attention_layers == config["num_hidden_layers"]


def test_shipped_sizes_reproduce_the_measured_allocation():
    # The shipped profiles (docs/GUIDE.md, "Per-layer budgets"): SmolLM2 / Gemma invtopk sizes at max_kv 256.
    smol = layer_sizes(*_w_and_windows("smollm2-135m"), 256, 4)
    assert smol[:6] == [129, 154, 170, 297, 319, 293] and sum(smol) == 256 * 30
    gemma = layer_sizes(*_w_and_windows("gemma3-270m"), 256, 4)
    assert gemma == [177, 356, 144, 198, 135, 339, 214, 203, 209, 244, 243, 303, 344,
                     322, 303, 238, 279, 357]


def _w_and_windows(name):
    p = shipped_profile(name)
    return p.weights, p.windows


# --- "auto" resolution --------------------------------------------------------


def test_auto_on_a_random_model_is_uniform():
    model = tiny_llama(num_hidden_layers=3)
    assert resolve_layer_profile(model, "auto") is None
    cache = make_h2o_cache(model, H2OConfig(max_size=16))
    assert [c.max_size for c in cache] == [16, 16, 16]
    # A random model with a packaged model's exact shapes is still not that model.
    from mlx_h2o.eval.bench import random_model

    assert resolve_layer_profile(random_model("smollm2-135m"), "auto") is None


def test_auto_uses_the_profile_of_a_packaged_model(tmp_path, monkeypatch):
    model = as_packaged(tiny_llama(num_hidden_layers=3), "tiny", [1.0, 3.0, 2.0],
                        tmp_path, monkeypatch)
    cfg = H2OConfig(max_size=32, sink_size=2, heavy_budget=16)
    sizes = [c.max_size for c in make_h2o_cache(model, cfg, layer_budget="auto")]
    assert sizes == layer_sizes([1.0, 3.0, 2.0], (None,) * 3, 32, 2) == [16, 48, 32]
    # the default: max_size in every layer, so nothing is evicted before max_size tokens
    assert [c.max_size for c in make_h2o_cache(model, cfg)] == [32] * 3
    assert [c.max_size for c in make_h2o_cache(model, cfg, layer_budget="uniform")] == [32] * 3
    # total memory: the uniform budget's
    assert sum(sizes) == 3 * cfg.max_size
    # an explicit path wins over "auto", and a LayerProfile object works too
    path = tmp_path / "other.json"
    save_profile(profile_for(model, [3.0, 1.0, 2.0]), path)
    assert [c.max_size for c in make_h2o_cache(model, cfg, layer_budget=path)] == [48, 16, 32]
    prof = profile_for(model, [1.0, 1.0, 2.0])
    assert [c.max_size for c in make_h2o_cache(model, cfg, layer_budget=prof)] == [24, 24, 48]


def test_packaged_name_with_a_wrong_layer_count_is_refused(tmp_path, monkeypatch):
    model = as_packaged(tiny_llama(num_hidden_layers=3), "tiny", [1.0, 3.0, 2.0],
                        tmp_path, monkeypatch)
    other = tiny_llama(num_hidden_layers=2)
    setattr(other, PACKAGED_ATTR, "tiny")
    with pytest.raises(ValueError, match="3 attention layers, the model 2.*calibrate"):
        make_h2o_cache(other, H2OConfig(max_size=16), layer_budget="auto")
    assert len(make_h2o_cache(model, H2OConfig(max_size=16), layer_budget="auto")) == 3


def test_profile_must_match_sliding_windows():
    model = tiny_gemma3()  # windows (16, 16, None)
    bad = LayerProfile(statistic="invtopk", weights=(1.0, 1.0, 1.0), attention_layers=3,
                       windows=(None, None, None))
    with pytest.raises(ValueError, match="sliding windows differ"):
        make_h2o_cache(model, H2OConfig(max_size=16), layer_budget=bad)


def test_layer_sizes_and_layer_budget_conflict(tmp_path):
    model = tiny_llama()
    cfg = H2OConfig(max_size=16)
    assert [c.max_size for c in make_h2o_cache(model, cfg, layer_sizes=[8, 24])] == [8, 24]
    for budget in ("auto", tmp_path / "p.json"):
        with pytest.raises(ValueError, match="both set the per-layer sizes"):
            make_h2o_cache(model, cfg, layer_sizes=[8, 24], layer_budget=budget)
    with pytest.raises(TypeError, match="layer_budget must be"):
        make_h2o_cache(model, cfg, layer_budget=3)


def test_profile_too_small_for_pinned_names_the_profile(tmp_path, monkeypatch):
    model = as_packaged(tiny_llama(), "tiny", [1.0, 7.0], tmp_path, monkeypatch)
    cfg = H2OConfig(max_size=32, sink_size=2, pinned=((4, 16),))
    with pytest.raises(ValueError, match="layer profile .*layer 0.*layer_budget='uniform'"):
        make_h2o_cache(model, cfg, layer_budget="auto")


# --- bad profile files ----------------------------------------------------------


def _good(model=None):
    return profile_for(model or tiny_llama(), [1.0, 2.0]).to_dict()


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda d: d.update(weights=[1.0]), "1 weights for attention_layers=2"),
        (lambda d: d.update(weights=[1.0, -0.5]), "finite numbers >= 0"),
        (lambda d: d.update(weights=[0, 0]), "not all 0"),
        (lambda d: d.update(weights=[1.0, "x"]), "finite numbers"),
        (lambda d: d.update(windows=[None]), "'windows' must hold"),
        (lambda d: d.update(format="other/1"), "not a layer profile"),
        (lambda d: d.pop("weights"), "missing \\['weights'\\]"),
        (lambda d: d.update(attention_layers=0), "attention_layers"),
    ],
)
def test_bad_profiles_raise_clear_errors(tmp_path, edit, match):
    d = _good()
    edit(d)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(d))
    with pytest.raises(ValueError, match=match) as e:
        load_profile(path)
    assert str(path) in str(e.value) and "mlx-h2o calibrate" in str(e.value)


def test_unreadable_profile_files(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text("{not json")
    with pytest.raises(ValueError, match="not readable JSON.*mlx-h2o calibrate"):
        load_profile(path)
    with pytest.raises(ValueError, match="does not exist"):
        make_h2o_cache(tiny_llama(), H2OConfig(max_size=16),
                       layer_budget=tmp_path / "missing.json")


def test_profile_wrong_layer_count_for_the_model(tmp_path):
    path = tmp_path / "three.json"
    save_profile(profile_for(tiny_llama(num_hidden_layers=3), [1, 2, 3]), path)
    with pytest.raises(ValueError, match="3 attention layers, the model 2"):
        make_h2o_cache(tiny_llama(), H2OConfig(max_size=16), layer_budget=path)


def test_save_is_atomic_and_round_trips(tmp_path, monkeypatch):
    p = profile_for(tiny_llama(), [0.25, 0.75])
    path = save_profile(p, tmp_path / "p.json")
    q = load_profile(path)
    assert q.weights == p.weights and q.windows == p.windows and q.source == str(path)
    assert json.loads(path.read_text())["format"] == FORMAT

    def boom(*a):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError, match="disk full"):
        save_profile(p, tmp_path / "q.json")
    assert sorted(f.name for f in tmp_path.iterdir()) == ["p.json"]  # no temp file left


# --- calibrate command -------------------------------------------------------------


def test_calibrate_writes_a_profile_atomically(tmp_path, monkeypatch, capsys):
    from mlx_h2o.cli import calibrate as cli

    model = tiny_llama(num_hidden_layers=3)
    monkeypatch.setattr(cli, "load_any", lambda name: (model, None))
    monkeypatch.chdir(tmp_path)  # --model tiny-path: a model folder, checked before loading
    (tmp_path / "tiny-path").mkdir()
    (tmp_path / "tiny-path" / "config.json").write_text("{}")
    monkeypatch.setattr("mlx_h2o.eval.calibrate.layer_weights",
                        lambda m, tok, stat, c=None: (0.5, 0.25, 0.25))
    out = tmp_path / "tiny.json"
    assert cli.main(["--model", "tiny-path", "--corpus", "python-docs", "--out", str(out)]) == 0
    p = load_profile(out)
    assert p.weights == (0.5, 0.25, 0.25) and p.attention_layers == 3
    assert p.calibration["corpus"] == "python-docs" and p.model_type == "llama"
    assert p.made_by["command"] == f"mlx-h2o calibrate --model tiny-path --corpus python-docs --out {out}"

    def fail(*a, **k):
        raise RuntimeError("interrupted")

    # Interrupted after the temp file is written: neither it nor the target remains.
    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(RuntimeError):
        cli.main(["--model", "tiny-path", "--out", str(tmp_path / "t2.json")])
    assert sorted(f.name for f in tmp_path.iterdir()) == ["tiny-path", "tiny.json"]
    with pytest.raises(SystemExit) as e:  # one line naming --out, exit code 2
        cli.main(["--out", str(tmp_path / "no" / "dir.json")])
    assert e.value.code == 2
    assert "--out" in capsys.readouterr().err


# --- caches built from a profile -------------------------------------------------------


def test_exact_when_nothing_is_evicted(tmp_path, monkeypatch):
    model = as_packaged(tiny_llama(num_hidden_layers=3), "tiny", [1.0, 3.0, 2.0],
                        tmp_path, monkeypatch)
    cache = make_h2o_cache(model, H2OConfig(max_size=48), layer_budget="auto")  # 24, 72, 48
    assert min(c.max_size for c in cache) == 24
    tokens = mx.random.randint(0, VOCAB, (2, 24), key=mx.random.key(1))
    ref = run(model, make_prompt_cache(model), tokens, 8)
    out = run(model, cache, tokens, 8)
    # Same tolerance as test_integration's within-budget equivalence (reference
    # attention vs mlx's SDPA differ in float32 rounding only).
    np.testing.assert_allclose(np.array(out), np.array(ref), atol=2e-4, rtol=1e-4)
    assert all(c.evicted == 0 for c in cache)


def test_stats_under_a_profile_are_means_over_layers(tmp_path, monkeypatch):
    model = as_packaged(tiny_llama(num_hidden_layers=3), "tiny", [1.0, 3.0, 2.0],
                        tmp_path, monkeypatch)
    cache = make_h2o_cache(model, H2OConfig(max_size=48), layer_budget="auto")  # 24, 72, 48
    run(model, cache, mx.random.randint(0, VOCAB, (1, 40), key=mx.random.key(4)), 8)
    stats = mlx_h2o.cache_stats(cache)
    assert (stats.layer_kept, stats.layer_evicted) == ((24, 40, 40), (16, 0, 0))
    # 104 / 3 kept and 16 / 3 evicted a layer: they add up to the 40 tokens seen
    assert (stats.tokens_seen, stats.tokens_kept, stats.tokens_evicted) == (40, 34.67, 5.33)
    assert stats.tokens_kept + stats.tokens_evicted == 40
    assert ("seen 40 = kept 34.67 (24..40 by layer) + evicted 5.33; budget 24..72, mean "
            "48 a layer") in stats.summary()
    usage = stats.usage()
    assert (usage["max_kv_size"], usage["layer_max_size"]) == (48, [24, 72])


def test_per_layer_cache_round_trips_and_stats(tmp_path, monkeypatch):
    model = as_packaged(tiny_gemma3(), "tiny", [1.0, 3.0, 2.0], tmp_path, monkeypatch)
    cfg = H2OConfig(max_size=12, sink_size=2)
    cache = make_h2o_cache(model, cfg, layer_budget="auto")
    sizes = [c.max_size for c in cache]
    assert sizes == layer_sizes([1.0, 3.0, 2.0], (16, 16, None), 12, 2) and len(set(sizes)) > 1
    tokens = mx.random.randint(0, VOCAB, (1, 40), key=mx.random.key(2))
    run(model, cache, tokens, 10)
    stats = mlx_h2o.cache_stats(cache)
    assert stats.layer_kept == tuple(sizes) and sum(sizes) == 3 * 12  # every layer full
    assert (stats.tokens_seen, stats.tokens_kept, stats.tokens_evicted) == (40, 12, 28)
    file = str(tmp_path / "c.safetensors")
    save_prompt_cache(file, cache)
    loaded = load_prompt_cache(file)
    assert [c.max_size for c in loaded] == sizes
    assert [c.config for c in loaded] == [c.config for c in cache]
    assert [c.window_size for c in loaded] == [16, 16, None]
    nxt = mx.array([[5, 9, 2]])
    a = run(model, cache, nxt, 3)
    b = run(model, loaded, nxt, 3)
    # Same decisions; the same floats on the CPU. On a GPU a step of the one
    # and of the other may take different kernels (the first after loading
    # has no victim from a fold kernel): float32 rounding (seen on an H200).
    for c, d in zip(cache, loaded):
        assert (c.offset, c.evicted, c.size()) == (d.offset, d.evicted, d.size())
        n = c.size()
        assert mx.array_equal(c.positions[..., :n], d.positions[..., :n])
    tol = 0 if mx.default_device() == mx.cpu else 1e-5
    np.testing.assert_allclose(np.array(a), np.array(b), rtol=tol, atol=tol)


def test_profile_path_in_the_package_data():
    here = Path(mlx_h2o.__file__).parent / "profiles"
    assert sorted(p.stem for p in here.glob("*.json")) == sorted(PACKAGED_MODELS)


def test_quantized_cache_type_takes_the_per_layer_sizes(tmp_path, monkeypatch):
    from mlx_h2o.cache.quantized import QuantConfig, quantized_cache_type

    model = as_packaged(tiny_llama(num_hidden_layers=3, head_dim=32), "tiny",
                        [1.0, 3.0, 2.0], tmp_path, monkeypatch)
    qt = quantized_cache_type(QuantConfig(bits=8, group_size=32))
    cache = make_h2o_cache(model, H2OConfig(max_size=32, sink_size=2), qt, layer_budget="auto")
    assert [c.max_size for c in cache] == [16, 48, 32]
    assert all(type(c).__name__ == "QuantizedH2OKVCache" for c in cache)
    tokens = mx.random.randint(0, VOCAB, (1, 60), key=mx.random.key(3))
    run(model, cache, tokens, 20)
    assert [c.size() for c in cache] == [16, 48, 32]


def test_generate_passes_the_layer_budget(tmp_path, monkeypatch):
    from mlx_h2o.integration.generate import _h2o_cache

    model = as_packaged(tiny_llama(num_hidden_layers=3), "tiny", [1.0, 3.0, 2.0],
                        tmp_path, monkeypatch)
    cfg = H2OConfig(max_size=32, sink_size=2)
    kwargs = {"layer_budget": "auto"}
    assert [c.max_size for c in _h2o_cache(model, None, cfg, kwargs)] == [16, 48, 32]
    assert kwargs == {}  # not passed on to mlx-lm
    assert [c.max_size for c in _h2o_cache(model, None, cfg, {})] == [32] * 3  # uniform
