"""scripts/plot_kernel_trace.py: GPU us per kernel from bench_kernels.py --trace logs."""

import importlib.util
import os

import pytest

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "scripts", "plot_kernel_trace.py")
spec = importlib.util.spec_from_file_location("plot_kernel_trace", SCRIPT)
plot = importlib.util.module_from_spec(spec)
spec.loader.exec_module(plot)

LOG = """   D      N  ours us   mlx us  ratio
  64   4096     33.4     32.0   1.04    251      2.3   14.58  10.0/1.0    23.4/30.9   default
  64   4096     31.4     32.0   0.98    267      2.3   13.69   9.7/1.0    21.6/30.9   MMA=0
       trace {}: 10.9 us a call: h2o_attn1mma_none 7.9, h2o_attn2_00 3.1
       trace {'MMA': 0}: 12.5 us a call: h2o_attn1_none 9.3, h2o_attn2_00 3.2
       trace mlx: 11.5 us a call: flash_fprop_ 8.8, void lean_reduction_kernel<false, f 2.7
 128  32768     58.6     48.4   1.21   2288     36.6    1.60   6.5/1.1    52.2/47.3
       trace default: 46.8 us a call: h2o_attn1_none 43.0, h2o_attn2_00 3.8
       trace MMA=2,MAX_ROWS=4: 50.0 us a call: h2o_attn1mma_none 46.0, h2o_attn2_00 4.0
"""


def test_traces_by_cell_and_variant(tmp_path):
    log = tmp_path / "trace.log"
    log.write_text(LOG)
    data = plot.traces(str(log))
    assert list(data) == [(64, 4096), (128, 32768)]
    assert data[(64, 4096)] == {"defaults": [7.9, 3.1], "MMA=0": [9.3, 3.2],
                                "MLX (cuDNN)": [8.8, 2.7]}  # a ", " inside a kernel name
    assert data[(128, 32768)] == {"defaults": [43.0, 3.8], "MMA=2,MAX_ROWS=4": [46.0, 4.0]}


def test_bad_logs_are_refused(tmp_path):
    log = tmp_path / "bad.log"
    log.write_text("       trace mlx: 1.0 us a call: k 1.0\n")
    with pytest.raises(ValueError, match="before any"):
        plot.traces(str(log))
    log.write_text(LOG.splitlines()[1] + "\n")
    with pytest.raises(ValueError, match="--trace"):
        plot.traces(str(log))


def test_figure(tmp_path, monkeypatch):
    log, out = tmp_path / "trace.log", tmp_path / "fig.png"
    log.write_text(LOG)
    monkeypatch.setattr("sys.argv", ["plot", str(log), str(out)])
    assert plot.main() == 0 and out.stat().st_size > 1000


def test_logs_side_by_side(tmp_path, monkeypatch):
    before, after, out = tmp_path / "a.log", tmp_path / "b.log", tmp_path / "fig.png"
    before.write_text(LOG)
    after.write_text(LOG.replace("7.9, h2o_attn2_00 3.1", "7.5, h2o_attn2_00 2.7"))
    data = plot.merged([f"before={before}", f"after={after}"])
    assert data[(64, 4096)]["before: defaults"] == [7.9, 3.1]
    assert data[(64, 4096)]["after: defaults"] == [7.5, 2.7]
    assert data[(64, 4096)]["after: MLX (cuDNN)"] == [8.8, 2.7]
    assert list(data[(128, 32768)]) == ["before: defaults", "before: MMA=2,MAX_ROWS=4",
                                        "after: defaults", "after: MMA=2,MAX_ROWS=4"]
    assert plot.merged([str(before)]) == plot.traces(str(before))  # one log: names as they are
    monkeypatch.setattr("sys.argv", ["plot", f"before={before}", f"after={after}", str(out)])
    assert plot.main() == 0 and out.stat().st_size > 1000
