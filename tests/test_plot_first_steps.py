"""scripts/plot_first_steps.py: pause time per gpu_step_times.py run, and the figure."""

import importlib.util
import os

import pytest

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "scripts", "plot_first_steps.py")
spec = importlib.util.spec_from_file_location("plot_first_steps", SCRIPT)
plot = importlib.util.module_from_spec(spec)
spec.loader.exec_module(plot)

LOG = """== cubin=on
h2o_evict_256 context=4096 steps=100 median 4.87 ms, total 0.61 s, mlx 0.32.4
prompt: 1.01 s in chunks of 512, 0 new JIT files
step    0:      87.7 ms  new JIT files: 0
h2o_no_evict context=4096 steps=40 median 5.00 ms, total 3.20 s, mlx 0.32.4
h2o_evict_256 context=4096 steps=100 median 7.00 ms, total 5.70 s, mlx 0.32.4
"""


def test_pauses_are_total_less_steps_times_median(tmp_path):
    log = tmp_path / "steps.log"
    log.write_text(LOG)
    assert plot.pauses(str(log), "h2o_evict_256") == pytest.approx([0.123, 5.0])
    assert plot.pauses(str(log), "h2o_no_evict") == pytest.approx([3.0])
    assert plot.pauses(str(log), "kvcache") == []


def test_figure_and_bad_entries(tmp_path, monkeypatch):
    log, out = tmp_path / "steps.log", tmp_path / "fig.png"
    log.write_text(LOG)
    argv = ["plot", str(out), f"A,ours,{log},h2o_evict_256", f"A,mlx,{log},h2o_evict_256,1"]
    monkeypatch.setattr("sys.argv", argv)
    assert plot.main() == 0 and out.stat().st_size > 0
    monkeypatch.setattr("sys.argv", argv[:2] + [f"A,ours,{log},h2o_evict_256,2"])
    with pytest.raises(SystemExit, match="2 runs of h2o_evict_256, no run 2"):
        plot.main()
    with pytest.raises(ValueError, match="GROUP,SERIES,LOG,STRATEGY"):
        plot.parse_entry("only,three,parts")
