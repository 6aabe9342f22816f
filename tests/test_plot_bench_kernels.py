"""benchmarks/plot_bench_kernels.py: ratios per (D, N) from bench_kernels.py logs, by variant."""

import importlib.util
import json
import os

import pytest

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "plot_bench_kernels.py")
spec = importlib.util.spec_from_file_location("plot_bench_kernels", SCRIPT)
plot = importlib.util.module_from_spec(spec)
spec.loader.exec_module(plot)


def _run(rows):
    return json.dumps({"attention": rows}) + "\n"


def _log(tmp_path):
    row = dict(D=64, N=1024)
    text = "D N ours mlx\n" + _run([  # a --variants run: a row per variant
        {**row, "ratio": 1.2, "variant": {}}, {**row, "ratio": 1.5, "variant": {"MMA": 0}}])
    text += _run([{**row, "ratio": 1.0, "variant": {}}, {**row, "ratio": 1.7, "variant": {"MMA": 0}}])
    text += _run([{**row, "ratio": 0.8}])  # a run from before --variants: the defaults
    path = tmp_path / "bench.log"
    path.write_text(text)
    return str(path)


def test_ratios_take_the_median_of_a_variants_runs(tmp_path):
    log = _log(tmp_path)
    assert plot.ratios(log) == {(64, 1024): pytest.approx(1.0)}  # 1.2, 1.0, 0.8
    assert plot.ratios(log, "MMA=0") == {(64, 1024): pytest.approx(1.6)}


def test_bad_variants_are_refused(tmp_path):
    log = _log(tmp_path)
    with pytest.raises(ValueError, match="no bench_kernels.py JSON row of variant 'MMA=2'"):
        plot.ratios(log, "MMA=2")
    with pytest.raises(ValueError, match="want NAME=INT"):
        plot.knobs("MMA")


def test_figure(tmp_path, monkeypatch):
    log, out = _log(tmp_path), tmp_path / "fig.png"
    monkeypatch.setattr("sys.argv", ["plot", log, log, str(out), "--before-variant", "MMA=0"])
    assert plot.main() == 0 and out.stat().st_size > 1000
