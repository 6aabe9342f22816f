"""Perplexity protocols, strategies and results dirs on tiny random models."""

import json
import math

import mlx.core as mx
import mlx.nn as nn
import pytest
from tiny_models import VOCAB, tiny_gemma3, tiny_llama
from mlx_lm.models.cache import KVCache, RotatingKVCache

from mlx_h2o import H2OKVCache
from mlx_h2o.eval import ppl
from mlx_h2o.eval.results import ResultsDir, write_json
from mlx_h2o.eval.strategies import parse_strategy


@pytest.fixture(scope="module")
def llama():
    return tiny_llama()


def tokens(B=3, L=40, seed=1):
    return mx.random.randint(0, VOCAB, (B, L), key=mx.random.key(seed))


def full_forward_nll(model, toks):
    logits = model(toks[:, :-1]).astype(mx.float32)
    return nn.losses.cross_entropy(logits, toks[:, 1:], reduction="none")


def test_paper_splits_at_256_and_scaled():
    splits = {"h2o-recent": (32, 220), "h2o-balanced": (64, 188), "h2o-heavy": (128, 124)}
    for name, (heavy, recent) in splits.items():
        cfg = parse_strategy(name).h2o_config(256)
        assert (cfg.sink_size, cfg.heavy_budget, cfg.recent_budget) == (4, heavy, recent)
    cfg = parse_strategy("h2o-heavy").h2o_config(1024)
    assert (cfg.heavy_budget, cfg.recent_budget) == (512, 508)


def test_strategy_options_and_errors():
    s = parse_strategy("h2o-balanced-norm:ema_alpha=0.9,sink=8")
    cfg = s.h2o_config(256)
    assert (cfg.score, cfg.ema_alpha, cfg.sink_size, cfg.heavy_budget) == (
        "normalized", 0.9, 8, 64)
    assert parse_strategy("h2o:heavy=100").h2o_config(256).heavy_budget == 100
    for bad in ("lru", "h2o-huge", "h2o-heavy:nope=1", "rotating:score=ema", "h2o:x"):
        with pytest.raises(ValueError):
            parse_strategy(bad)


def test_rotating_keeps_model_windows():
    model = tiny_gemma3()  # sliding window 16 on local layers
    caches = parse_strategy("rotating").make_cache(model, 64)
    assert [type(c) for c in caches] == [RotatingKVCache] * 3
    assert [(c.max_size, c.keep) for c in caches] == [(16, 0), (16, 0), (64, 4)]
    h2o = parse_strategy("h2o-heavy").make_cache(model, 64)
    assert all(isinstance(c, H2OKVCache) for c in h2o)


def test_decode_protocol_matches_full_forward(llama):
    toks = tokens()
    cache = parse_strategy("baseline").make_cache(llama, 0)
    assert all(type(c) is KVCache for c in cache)
    nll = ppl.decode_nll(llama, toks, cache, prefill=8)
    ref = full_forward_nll(llama, toks)[:, 7:]
    assert nll.shape == (3, 32)
    assert mx.allclose(nll, ref, atol=1e-4).item()


@pytest.mark.parametrize("step", [5, 8, 10, 20])
def test_a_prefill_in_steps_is_the_prefill_in_one(llama, step):
    toks = tokens()
    one = ppl.decode_nll(llama, toks, parse_strategy("baseline").make_cache(llama, 0), 20)
    steps = ppl.decode_nll(llama, toks, parse_strategy("baseline").make_cache(llama, 0), 20,
                           prefill_step=step)
    assert mx.allclose(steps, one, atol=1e-4).item()
    # Bounded: steps shorter than the prompt are chunks compacted before its
    # end (its first step already overflows the 12-token budget).
    h2o = parse_strategy("h2o-heavy:prefill_compact=chunk")
    bounded = [ppl.decode_nll(llama, toks, h2o.make_cache(llama, 12), 20, prefill_step=s)
               for s in (step, 0)]
    assert mx.allclose(bounded[0], bounded[1], atol=1e-4).item() == (step >= 20)


@pytest.mark.parametrize("mode", ["decode", "chunked"])
def test_bounded_strategies_equal_baseline_within_budget(llama, mode):
    toks = tokens()
    base = ppl.run_ppl(llama, toks, parse_strategy("baseline"), 0, mode, 8, 7)
    for name in ("rotating", "h2o-heavy", "h2o-recent-acc", "h2o-balanced-norm"):
        r = ppl.run_ppl(llama, toks, parse_strategy(name), 40, mode, 8, 7)
        assert r["nll_per_sample"] == pytest.approx(base["nll_per_sample"], abs=1e-5)


def test_eviction_changes_ppl_and_batches_agree(llama):
    toks = tokens(B=4, L=48)
    st = parse_strategy("h2o-heavy")
    base = ppl.run_ppl(llama, toks, parse_strategy("baseline"), 0, prefill=8)
    whole = ppl.run_ppl(llama, toks, st, 16, prefill=8)
    split = ppl.run_ppl(llama, toks, st, 16, prefill=8, batch_size=1)
    assert abs(whole["nll"] - base["nll"]) > 1e-4
    # Per-sequence eviction: a batch decides like each sample alone.
    assert whole["nll_per_sample"] == pytest.approx(split["nll_per_sample"], abs=1e-4)


def test_summary_statistics():
    nll = mx.array([[1.0, 3.0], [2.0, 2.0], [4.0, 2.0]])
    s = ppl.summarize(nll)
    assert s["ppl"] == pytest.approx(math.exp(14 / 6))
    per = [2.0, 2.0, 3.0]
    se = math.sqrt(sum((v - 7 / 3) ** 2 for v in per) / 2 / 3)
    assert s["ppl_se"] == pytest.approx(s["ppl"] * se)
    other = dict(nll_per_sample=[v + 0.1 for v in per])
    d = ppl.compare(other, s)
    assert d["delta_pct"] == pytest.approx(100 * (math.exp(0.1) - 1))
    assert d["delta_se_pct"] == pytest.approx(0.0, abs=1e-9)


def test_sweep_saves_and_skips_finished(llama, tmp_path):
    data = {24: tokens(B=2, L=24)}
    sts = [parse_strategy(s) for s in ("baseline", "rotating", "h2o-heavy")]
    cfg = {"model": "tiny", "mode": "decode"}
    rdir = ResultsDir(str(tmp_path), "ppl", cfg, ("model",))
    logs = []
    rows = ppl.sweep(llama, data, sts, [12, 16], rdir, logs.append, prefill=4)
    assert len(rows) == 5 and rows[0]["delta_pct"] == pytest.approx(0.0)
    assert json.loads((rdir.path / "config.json").read_text()) == cfg
    again = ppl.sweep(llama, data, sts, [12, 16], rdir, logs.append, prefill=4)
    assert sum("skipped" in line for line in logs) == 5
    assert [r["ppl"] for r in again] == [r["ppl"] for r in rows]
    assert not list(rdir.path.glob(".*tmp"))
    other = ResultsDir(str(tmp_path), "ppl", dict(cfg, mode="chunked"), ("model",))
    assert other.path != rdir.path


def test_atomic_write_keeps_old_file_on_error(tmp_path):
    f = tmp_path / "r.json"
    write_json(f, {"a": 1})
    with pytest.raises(TypeError):
        write_json(f, {"a": object.__new__(type("X", (), {"__str__": None}))})
    assert json.loads(f.read_text()) == {"a": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["r.json"]


def test_ratio_vs_matches_hand_computation():
    base = {"nll_per_sample": [3.0, 3.2, 2.9, 3.1]}
    ref = {"nll_per_sample": [3.03, 3.23, 2.93, 3.13]}  # +3% (exactly 0.03 nats each)
    cand = {"nll_per_sample": [3.01, 3.21, 2.91, 3.11]}  # +1%
    out = ppl.ratio_vs(cand, ref, base, boot=200)
    er, ec = math.exp(0.03) - 1, math.exp(0.01) - 1
    assert out["ratio"] == pytest.approx(ec / er)
    assert out["ratio_se"] == pytest.approx(0, abs=1e-9)  # constant differences
    assert out["margin_pct"] == pytest.approx(100 * (ec - er / 3))
    lo, hi = out["ratio_ci95"]
    assert lo == pytest.approx(ec / er) and hi == pytest.approx(ec / er)


def test_ratio_vs_se_agrees_with_bootstrap():
    rng = __import__("numpy").random.default_rng(3)
    base = rng.normal(3, 0.2, 200)
    ref = base + rng.normal(0.03, 0.01, 200)
    cand = base + 0.3 * (ref - base) + rng.normal(0, 0.004, 200)
    out = ppl.ratio_vs({"nll_per_sample": list(cand)}, {"nll_per_sample": list(ref)},
                       {"nll_per_sample": list(base)}, boot=4000)
    lo, hi = out["ratio_ci95"]
    # for n = 200 the bootstrap interval is ~ +-1.96 se around R
    assert (hi - lo) / (2 * 1.96) == pytest.approx(out["ratio_se"], rel=0.15)
    assert lo < out["ratio"] < hi


def test_quantized_strategies():
    from mlx_h2o.cache import MixedPrecisionH2OKVCache, QuantizedH2OKVCache

    llama = tiny_llama(head_dim=64)  # quantization groups of up to 64 along head_dim

    q8 = parse_strategy("h2o-heavy:kv_bits=8,layer_budget=uniform")
    mixed = parse_strategy("h2o-heavy:kv_mixed=true,kv_group_size=32,layer_budget=uniform")
    dense = parse_strategy("h2o-heavy:layer_budget=uniform")
    assert (q8.quant.bits, q8.quant.group_size, q8.quant.recent_bits) == (8, 64, None)
    assert (mixed.quant.bits, mixed.quant.group_size, mixed.quant.recent_bits) == (8, 32, 4)
    assert len({q8.key(16), mixed.key(16), dense.key(16)}) == 3  # never share results
    assert q8.describe(16)["kv_quant"] == {"bits": 8, "group_size": 64, "recent_bits": None}
    caches = q8.make_cache(llama, 16)
    assert all(type(c) is QuantizedH2OKVCache and c.quant == q8.quant for c in caches)
    assert all(type(c) is MixedPrecisionH2OKVCache for c in mixed.make_cache(llama, 16))
    # 8-bit K/V under the same eviction: close to dense H2O, not equal.
    toks = tokens(B=2, L=48)
    a = ppl.run_ppl(llama, toks, dense, 16, prefill=8)
    b = ppl.run_ppl(llama, toks, q8, 16, prefill=8)
    assert a["nll"] != b["nll"] and abs(a["nll"] - b["nll"]) < 0.05
    for bad in ("h2o-heavy:kv_bits=3", "rotating:kv_bits=8", "h2o-heavy:kv_mixed=2",
                "h2o-heavy:kv_bits=4,kv_mixed=true", "h2o-heavy:kv_group_size=32",
                "h2o-heavy:kv_bits=8,kv_group_size=48"):
        with pytest.raises(ValueError):
            parse_strategy(bad)
