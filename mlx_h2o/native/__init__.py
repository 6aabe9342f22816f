"""Native helper: replay a recorded launch of MLX primitives from C++.

``Replay(fn)`` stands in for ``mx.compile(fn)`` where ``fn`` launches custom
kernels on inputs of fixed shapes. ``replayer(fn, inputs, outputs)`` turns
one plain call ``outputs = fn(*inputs)`` into a callable for later calls
with inputs of the same shapes and dtypes: a native ``Tape`` (``replay.cpp``,
built once per machine by ``loader.load``) where it can be built, else
``mx.compile(fn)``. Both build the same graph; the Tape skips mx.compile's
Python tree handling (docs/GPU.md, session 20) and returns None for inputs
whose count, shapes or dtypes differ from the recording (mx.compile would
retrace). Custom-kernel launches only: a Tape replays nodes as recorded,
without mx.compile's fusion of elementwise ops.
"""

from typing import Callable, Sequence

import mlx.core as mx

from .loader import CACHE_ENV, build, cache_dir, load

__all__ = ["CACHE_ENV", "Replay", "build", "cache_dir", "load", "replayer"]


def replayer(fn: Callable, inputs: Sequence[mx.array], outputs: Sequence[mx.array]) -> Callable:
    """A callable that rebuilds ``fn``'s graph for new inputs (shapes and
    dtypes as ``inputs``), recorded from the call that gave ``outputs``."""
    module = load()
    tape = None if module is None else module.record(list(inputs), list(outputs))
    # None: no native module, or one array passed as two inputs.
    return mx.compile(fn) if tape is None else tape


class Replay:
    """``mx.compile(fn)`` for launches: the first call runs ``fn`` and records
    it (``replayer``), later calls replay the recording; a call whose input
    shapes or dtypes differ from it records again."""

    __slots__ = ("fn", "_replay")

    def __init__(self, fn: Callable):
        self.fn = fn
        self._replay = None

    def __call__(self, *arrays):
        replay = self._replay
        if replay is not None:
            outs = replay(*arrays)
            if outs is not None:
                return outs  # else other shapes: record again
        outs = self.fn(*arrays)
        self._replay = replayer(self.fn, arrays, outs)
        return outs
