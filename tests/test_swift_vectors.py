"""The Swift parity vectors (swift/Tests/Vectors) against the Python cache.

`swift test` replays the same files through H2OCore's H2OSlots; here we check
that they are what the Python implementation produces today: regenerating
gives byte-identical files, and feeding each file's recorded logits back
through H2OKVCache reproduces every recorded state (positions, victims,
offsets, scores).
"""

import importlib.util
import json
import os

import mlx.core as mx
import pytest

from mlx_h2o import policy
from mlx_h2o.config import config_from_dict
from mlx_h2o.scores import SCORE_MODES, SCORES

ROOT = os.path.join(os.path.dirname(__file__), "..")
VECTORS = os.path.join(ROOT, "swift", "Tests", "Vectors")


def _load(path, name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, path))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


gen = _load("tools/make_swift_vectors.py", "make_swift_vectors")
FILES = sorted(f for f in os.listdir(VECTORS) if f.endswith(".json"))
STREAMS = [f for f in FILES if f not in ("config_cases.json", "metal_kernels.json")]


@pytest.fixture(autouse=True)
def _cpu():
    # The vectors are generated on the CPU; keep any GPU default out of the way.
    with mx.stream(mx.cpu):
        yield


def _read(name):
    with open(os.path.join(VECTORS, name)) as f:
        return f.read()


def test_regenerating_gives_identical_files():
    docs = dict(gen.documents())
    assert sorted(docs) == [f for f in FILES if f != "metal_kernels.json"], (
        "run: python tools/make_swift_vectors.py"
    )
    for name, text in docs.items():
        assert text == _read(name), f"{name} is stale: run python tools/make_swift_vectors.py"


def test_vectors_are_small():
    total = sum(os.path.getsize(os.path.join(VECTORS, f)) for f in FILES)
    assert total < 200_000


@pytest.mark.parametrize("name", STREAMS)
def test_python_cache_replays_vectors(name):
    doc = json.loads(_read(name))
    assert doc["format"] == gen.FORMAT
    replayed = gen.run_stream(gen.Stream.from_document(doc))
    for i, (got, want) in enumerate(zip(replayed["steps"], doc["steps"])):
        assert got == want, f"{name} step {i} ({want['op']})"
    assert len(replayed["steps"]) == len(doc["steps"])


def test_streams_cover_the_issue():
    """Prefill overflow, GQA, B=2, a window layer, trims, decode evictions, ties,
    the three score modes, pinned ranges and a quantized cache."""
    docs = [json.loads(_read(f)) for f in STREAMS]
    steps = [st for d in docs for st in d["steps"]]
    assert any(d["n_heads"] > d["n_kv_heads"] for d in docs)
    assert any(d["batch_size"] == 2 for d in docs)
    assert any(d["window_size"] is not None for d in docs)
    # Modes scored from more than logits are not in the Swift core: it refuses
    # them by name (test_scores.py).
    assert {d["config"]["score"] for d in docs} == {
        m for m in SCORE_MODES if SCORES[m].from_logits}
    assert any(d["config"]["prefill_window"] for d in docs)
    assert any(d["config"]["prefill_pool"] > 1 for d in docs)
    assert any(d["config"]["pinned"] for d in docs)
    assert any(d["quant"] for d in docs)  # QuantizedH2OKVCache keeps the same slots
    assert any(st["op"] == "trim" and st["expect"]["evicted"] for st in steps)
    assert any(st["op"] == "trim" and not st["expect"]["evicted"] for st in steps)
    assert any(st["expect"].get("victims") for st in steps)
    # An overflowing chunk: more slots attended than kept.
    updates = [st for st in steps if st["op"] == "update"]
    assert any(st["expect"]["size"] < len(st["logits"]) // len(st["lse"]) for st in updates)
    # Later chunks that overflow a full cache: one replaced by its window, one
    # shorter than the window that adds (policy.window_replaces).
    later = [(config_from_dict(d["config"]), st["length"], prev["expect"]["size"])
             for d in docs for prev, st in zip(d["steps"], d["steps"][1:])
             if st["op"] == "update" and st["length"] > 1]
    full = [(c, L, n) for c, L, n in later if n >= c.max_size and c.prefill_window]
    assert any(policy.window_replaces(*x) for x in full)
    assert any(not policy.window_replaces(*x) for x in full)


def test_swift_metal_source_is_current():
    """The Swift package's kernel text is generated from mlx_h2o/kernels, not copied."""
    metal = _load("swift/scripts/make_metal_source.py", "make_metal_source")
    for path, text in metal.outputs():
        with open(path) as f:
            assert f.read() == text, f"{path} is stale: run make -C swift kernels"
