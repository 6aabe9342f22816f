"""Passkey, bench, profile and plots on tiny random models."""

import math

import mlx.core as mx
import pytest
from tiny_models import VOCAB, tiny_gemma3, tiny_llama

from mlx_h2o.eval import bench, passkey, plots, profile
from mlx_h2o.eval.strategies import parse_strategy


class CharTokenizer:
    """Printable ASCII, one token per character (fits the tiny models' vocab)."""

    def encode(self, text, add_special_tokens=True):
        return [ord(c) - 32 for c in text if 32 <= ord(c) < 32 + VOCAB]

    def decode(self, ids):
        return "".join(chr(i + 32) for i in ids)


def test_is_correct():
    assert passkey.is_correct(" 71432. The", "71432")
    assert passkey.is_correct("7 1 4 3 2", "71432")  # tokenizers that space digits
    assert not passkey.is_correct(" 7143", "71432")
    assert not passkey.is_correct(" 71433", "71432")
    assert passkey.budget_tokens(0.25, 2048) == 512
    assert passkey.budget_tokens(300, 2048) == 300


def test_passkey_batched_equals_one_by_one():
    model, tok = tiny_llama(), CharTokenizer()
    prompts = passkey.make_prompts(tok, [300], [0.2, 0.8], trials=2)
    assert len(prompts) == 4 and all(len(p["tokens"]) == 300 for p in prompts)
    st = parse_strategy("h2o-heavy")
    together = passkey.run_strategy(model, tok, prompts, st, 64, prefill_step=50)
    alone = passkey.run_strategy(model, tok, prompts, st, 64, prefill_step=50,
                                 batch_size=1)
    assert [t["output"] for t in together["trials"]] == [t["output"] for t in alone["trials"]]
    grid = passkey.accuracy_grid(together)
    assert set(grid) == {(300, 0.2), (300, 0.8)}
    assert together["accuracy"] == sum(t["correct"] for t in together["trials"]) / 4


def test_bench_trial_and_ratios():
    model = tiny_llama()
    prompt = mx.random.randint(0, VOCAB, (2, 40), key=mx.random.key(0))
    trials = [dict(trial=i, **bench.one_trial(model, prompt, parse_strategy(s), 16, 8, 16))
              for i in range(2) for s in ("baseline", "h2o-heavy")]
    rows = {r["strategy"]: r for r in bench.summarize(trials)}
    assert rows["baseline"]["decode_ratio"] == 1.0
    assert rows["h2o-heavy"]["kv_mb"] < rows["baseline"]["kv_mb"]
    fake = [{"strategy": "baseline", "max_kv": None, "prefill_tps": 10.0,
             "decode_tps": d, "peak_gb": 1.0, "kv_mb": 1.0} for d in (8.0, 10.0, 12.0)]
    fake += [{"strategy": "rotating", "max_kv": 8, "prefill_tps": 20.0,
              "decode_tps": 5.0, "peak_gb": 1.5, "kv_mb": 0.5}]
    rows = {r["strategy"]: r for r in bench.summarize(fake)}
    assert rows["baseline"]["decode_tps"] == 10.0
    assert rows["baseline"]["decode_spread_pct"] == pytest.approx(40.0)
    assert rows["rotating"]["decode_ratio"] == 0.5
    assert rows["rotating"]["peak_delta_gb"] == pytest.approx(0.5)


def test_attention_stats_of_uniform_and_peaked_rows():
    N = 10
    uniform = mx.zeros((1, 1, 1, N))
    s = profile.attention_stats(uniform, mx.full((1, 1, 1), math.log(N)), 0.2, 1)
    assert s["entropy"] == pytest.approx(math.log(N), rel=1e-5)
    assert s["entropy_norm"] == pytest.approx(1.0, rel=1e-5)
    assert s["topk_share"] == pytest.approx(0.2, rel=1e-5)
    assert s["score_cv"] == pytest.approx(0.0, abs=1e-5)
    assert s["sink_share"] == pytest.approx(0.1, rel=1e-5)
    peaked = mx.array([[[[30.0] + [0.0] * (N - 1)]]])
    lse = mx.logsumexp(peaked, axis=-1)
    s = profile.attention_stats(peaked, lse, 0.1, 1)
    assert s["entropy"] < 1e-6 and s["topk_share"] == pytest.approx(1.0)


def test_profile_model_one_row_per_layer(tmp_path):
    model = tiny_gemma3()
    toks = mx.random.randint(0, VOCAB, (2, 24), key=mx.random.key(3))
    rows = profile.profile_model(model, toks)
    assert [r["layer"] for r in rows] == [0, 1, 2]
    for r in rows:
        assert 0 < r["entropy_norm"] <= 1 + 1e-5 and 0 < r["topk_share"] <= 1 + 1e-5
    out = plots.plot_profile(rows, profile.STATS, tmp_path / "p.png")
    assert out.read_bytes()[:4] == b"\x89PNG"


def test_plots_write_pngs(tmp_path):
    rows = [{"strategy": "baseline", "max_kv": None, "seq_len": 64, "ppl": 10.0,
             "ppl_se": 0.1}]
    rows += [{"strategy": s, "max_kv": kv, "seq_len": 64, "ppl": 11.0 - kv / 100,
              "ppl_se": 0.1} for s in ("rotating", "h2o-heavy") for kv in (16, 32)]
    out = plots.plot_ppl(rows, "max_kv", tmp_path / "a.png")
    grids = {"h2o": {(512, 0.1): 1.0, (512, 0.5): 0.5}}
    out2 = plots.plot_heatmaps(grids, [512], [0.1, 0.5], tmp_path / "b.png")
    assert out.read_bytes()[:4] == out2.read_bytes()[:4] == b"\x89PNG"


def test_heatmap_title_wider_than_the_figure_is_wrapped_not_cut(tmp_path):
    """A one-cell panel is narrower than its title: the title's first and last
    letters must not reach the image's edges (a centred line loses both)."""
    import matplotlib.image

    cell = {("rotating", "2048\n25%"): 0.2, ("h2o-heavy", "2048\n25%"): 1.0}
    title = ("smollm2-135m: of the prompts the full cache answered, the share each "
             "strategy answers too")
    out = plots.plot_heatmaps({"answers kept": cell}, ["rotating", "h2o-heavy"],
                              ["2048\n25%"], tmp_path / "kept.png", title=title)
    image = matplotlib.image.imread(out)
    top = image[: image.shape[0] // 8, :, :3]  # the title's rows
    assert (top < 0.5).any()  # the title is drawn
    assert (top[:, :4] > 0.9).all() and (top[:, -4:] > 0.9).all()


def test_passkey_prefill_logits_match_full_forward():
    model = tiny_gemma3()
    toks = mx.random.randint(0, VOCAB, (2, 45), key=mx.random.key(5))
    cache = parse_strategy("baseline").make_cache(model, 0)
    got = passkey.prefill(model, toks, cache, step=16)  # chunks 16, 16, 13
    assert cache[0].offset == 45
    assert mx.allclose(got, model(toks)[:, -1], atol=1e-4).item()
