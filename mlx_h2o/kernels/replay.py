"""Launches of fixed shapes replayed by ``mx.compile`` after their first call.

A side-by-side decode run on an H100 (Qwen3-8B shapes, 4K / 256 and 16K / 1K,
KVCache, Rotating and H2O) measured no decode gain from a C++ replay of the
recording over ``mx.compile``'s within the run's noise, so ``mx.compile`` is
the one replay.
"""

from typing import Callable

import mlx.core as mx


def replayer(fn: Callable) -> Callable:
    """``fn`` compiled: a later call with inputs of the same shapes and dtypes
    replays its graph (other shapes trace it again)."""
    return mx.compile(fn)


def replay_after_first(owner, name: str, fn: Callable) -> None:
    """Set ``owner.<name>`` to ``fn``'s first call, which runs ``fn`` as is and
    puts ``mx.compile(fn)`` in its place: later calls replay the compiled
    graph directly, with no wrapper of ours on a decode token's path (a call
    with other shapes traces again). ``owner`` is a shared plan (its
    builders are cached), never deep-copied."""

    def first(*arrays):
        outs = fn(*arrays)
        setattr(owner, name, replayer(fn))
        return outs

    setattr(owner, name, first)
