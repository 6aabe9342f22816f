"""The native Tape (mlx_h2o/native/replay.cpp) against plain MLX graphs.

Built here like on a user's machine (once per machine into the cache dir);
skipped only where no C++ compiler or no Python headers exist. Graphs use plain MLX ops, which a
Tape replays like custom-kernel launches: multi-output primitives, constants,
inputs used twice, outputs that are inputs or constants.
"""

import shutil
import sysconfig
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from mlx_h2o import native
from mlx_h2o.native import loader as build

needs_cxx = pytest.mark.skipif(
    not (shutil.which("c++") or shutil.which("g++"))
    or not Path(sysconfig.get_paths()["include"], "Python.h").exists(),
    reason="no C++ compiler or no Python headers to build the Tape",
)


@pytest.fixture(scope="module")
def module():
    m = native.load()
    assert m is not None, "native.load() failed: see the warning for why"
    return m


def graph(q, k, v, p):
    a, b = mx.divmod(q * p[0] + 3.0, k)  # one primitive, two outputs
    c = mx.matmul(a, mx.swapaxes(v, -1, -2)) + mx.array(0.5)  # a constant
    return c, b, a + b, q  # the last output is an input


def inputs(rng, shape=(2, 3, 5, 4)):
    q, k, v = (mx.array(rng.uniform(1, 2, shape).astype(np.float32)) for _ in range(3))
    return [q, k, v, mx.array(rng.uniform(1, 2, (3,)).astype(np.float32))]


@needs_cxx
def test_tape_replays_the_graph_on_new_inputs(module):
    rng = np.random.default_rng(0)
    first = inputs(rng)
    tape = module.record(first, list(graph(*first)))
    assert tape.num_nodes >= 6
    for _ in range(3):
        args = inputs(rng)
        got, want = tape(*args), graph(*args)
        assert isinstance(got, tuple) and len(got) == 4
        for g, w in zip(got, want):
            assert g.shape == w.shape and g.dtype == w.dtype
            np.testing.assert_array_equal(np.array(g), np.array(w))
        assert got[3] is not args[0] and mx.array_equal(got[3], args[0])


@needs_cxx
def test_tape_keeps_arrays_that_do_not_depend_on_inputs(module):
    x = mx.array([1.0, 2.0])
    const = mx.zeros((2,)) + 4.0  # unevaluated, made outside: a constant
    tape = module.record([x], [x * const, const])
    y = mx.array([3.0, 5.0])
    prod, c = tape(y)
    assert prod.tolist() == [12.0, 20.0] and c.tolist() == [4.0, 4.0]


@needs_cxx
def test_tape_refuses_what_it_cannot_replay(module):
    x = mx.ones((2, 3))
    assert module.record([x, x], [x + x]) is None  # one array as two inputs
    y = mx.ones((2, 3))
    tape = module.record([x, y], [x - y])
    assert tape(x) is None  # too few inputs
    assert tape(x, mx.ones((3, 2))) is None  # another shape
    assert tape(x.astype(mx.float16), y) is None  # another dtype
    assert tape(x, np.ones((2, 3))) is None  # not an mx.array
    assert tape(x + 1, y)[0].tolist() == [[1.0] * 3] * 2


@needs_cxx
def test_replayer_uses_the_tape_and_falls_back_to_compile(module, monkeypatch):
    args = inputs(np.random.default_rng(1))
    outs = graph(*args)
    assert isinstance(native.replayer(graph, args, outs), module.Tape)
    # One array as two inputs: a Tape cannot tell them apart, mx.compile can.
    dup = [args[0], args[0], args[2], args[3]]
    fn = native.replayer(graph, dup, graph(*dup))
    assert not isinstance(fn, module.Tape)
    new = inputs(np.random.default_rng(2))
    assert mx.array_equal(fn(*new)[0], graph(*new)[0])
    monkeypatch.setattr(native, "load", lambda: None)
    assert not isinstance(native.replayer(graph, args, outs), module.Tape)


@needs_cxx
def test_build_is_cached_per_machine(tmp_path, monkeypatch):
    monkeypatch.setenv(build.CACHE_ENV, str(tmp_path))
    path = build.build()
    assert path.exists() and path.is_relative_to(tmp_path / mx.__version__)
    mtime = path.stat().st_mtime_ns
    assert build.build() == path and path.stat().st_mtime_ns == mtime  # not rebuilt
    leftovers = [p for p in path.parent.iterdir() if p != path]
    assert not leftovers, leftovers  # the work folder went with the build


def test_cache_env_turns_the_helper_off(monkeypatch):
    monkeypatch.setenv(build.CACHE_ENV, "0")
    assert build.cache_dir() is None
    with pytest.raises(RuntimeError, match="off"):
        build.build()


@needs_cxx
def test_replay_records_once_and_again_for_new_shapes(module):
    calls = []

    def fn(a, b):
        calls.append(a.shape)
        return mx.divmod(a + b, b)

    rep = native.Replay(fn)
    x, y = mx.array([5.0, 7.0]), mx.array([2.0, 3.0])
    for i in range(3):
        got = rep(x + i, y)
        assert [g.tolist() for g in got] == [g.tolist() for g in mx.divmod(x + i + y, y)]
    assert calls == [(2,)] and isinstance(rep._replay, module.Tape)
    z, w = mx.ones((3,)), mx.ones((3,))
    assert rep(z, w)[0].tolist() == [2.0, 2.0, 2.0] and calls == [(2,), (3,)]
    assert rep(z + 1, w)[0].tolist() == [3.0, 3.0, 3.0] and len(calls) == 2


def test_load_is_quiet_without_nanobind(monkeypatch, recwarn):
    monkeypatch.setattr(build.importlib.util, "find_spec", lambda name: None)
    assert build.load.__wrapped__() is None
    assert not recwarn.list  # the native extra is optional: no warning


def test_load_warns_when_the_build_fails(monkeypatch):
    monkeypatch.setattr(build, "build", lambda verbose=False: (_ for _ in ()).throw(
        RuntimeError("no C++ compiler (set CXX)")))
    with pytest.warns(UserWarning, match="no C\\+\\+ compiler"):
        assert build.load.__wrapped__() is None
