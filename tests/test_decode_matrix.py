"""benchmarks/decode_matrix.py's trace helpers, on a stand-in profiler (CPU)."""

import importlib.util
import os
import sys
from types import SimpleNamespace

SCRIPTS = os.path.join(os.path.dirname(__file__), "..", "benchmarks")


def load_script():
    sys.path.insert(0, SCRIPTS)
    try:
        spec = importlib.util.spec_from_file_location("decode_matrix", os.path.join(SCRIPTS, "decode_matrix.py"))
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(SCRIPTS)
    return module


def test_graph_api_counts_keeps_cuda_graph_calls_only():
    split = load_script()
    names = ["cudaGraphLaunch", "cudaGraphInstantiate", "cudaGraphLaunch", "cuGraphAddKernelNode",
             "cudaLaunchKernel", "custom_kernel_h2o_attn1", "cudaGraphExecUpdate_v2"]
    prof = SimpleNamespace(events=lambda: [SimpleNamespace(name=n) for n in names])
    counts = split.graph_api_counts(prof)
    assert counts == {"cudaGraphLaunch": 2, "cudaGraphInstantiate": 1, "cuGraphAddKernelNode": 1,
                      "cudaGraphExecUpdate_v2": 1}
    assert not split.graph_api_counts(SimpleNamespace(events=lambda: []))
