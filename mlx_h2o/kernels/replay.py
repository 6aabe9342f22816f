"""Launches of fixed shapes replayed by ``mx.compile`` after their first call.

A side-by-side decode run on an H100 (Qwen3-8B shapes, 4K / 256 and 16K / 1K,
KVCache, Rotating and H2O) measured no decode gain from a C++ replay of the
recording over ``mx.compile``'s within the run's noise, so ``mx.compile`` is
the one replay.
"""

from typing import Callable, Sequence

import mlx.core as mx


def replayer(fn: Callable, inputs: Sequence[mx.array], outputs: Sequence[mx.array]) -> Callable:
    """A callable that rebuilds ``fn``'s graph for new inputs of the shapes and
    dtypes of ``inputs`` (recorded from the call that gave ``outputs``)."""
    return mx.compile(fn)


class Replay:
    """``mx.compile(fn)`` for launches: the first call runs ``fn`` as is, later
    calls replay it compiled (a call with other shapes traces again)."""

    __slots__ = ("fn", "_replay")

    def __init__(self, fn: Callable):
        self.fn = fn
        self._replay = None

    def __call__(self, *arrays):
        if self._replay is not None:
            return self._replay(*arrays)
        outs = self.fn(*arrays)
        self._replay = replayer(self.fn, arrays, outs)
        return outs
