"""cache/first_use.py: when a fold kernel agrees with its reference (CPU).

The checks run on a Mac's first group fold and queue fold;
tests/test_metal_emulated.py runs them on the emulated Metal kernels. Here:
what counts as agreement.
"""

import mlx.core as mx
import numpy as np
import pytest

from mlx_h2o.cache import first_use


def fold(score, count, victims, positions=None):
    """A fold's (positions, score, count, victim, victims): 2 layers of B=1,
    Hk=2, 3 slots (rows of ``score`` are layer 0's, then layer 1's)."""
    score = mx.array(np.array(score, np.float32))
    count = mx.array(np.array(count, np.float32))
    pos = mx.array(np.arange(score.size, dtype=np.int32).reshape(score.shape)
                   if positions is None else np.array(positions, np.int32))
    vs = [mx.array(np.array(v, np.int32).reshape(1, 2, 1, 1)) for v in victims]
    return pos, score, count, mx.concatenate(vs, axis=0), vs


def state():
    """(score, count) of 2 layers x 2 heads x 3 slots; layer 1 head 0 holds a near tie."""
    score = np.array([[[0.5, 0.2, 0.9], [0.7, 0.1, 0.4]],
                      [[0.3, 0.3000001, 0.8], [0.6, 0.9, 0.2]]], np.float32)
    count = np.ones_like(score)
    return score, count


def test_equal_folds_agree():
    score, count = state()
    want = fold(score, count, [[1, 1], [0, 2]])
    assert first_use.group_differs("accumulated", want, want) is None


def test_a_near_tie_may_pick_either_slot():
    score, count = state()
    want = fold(score, count, [[1, 1], [0, 2]])
    got = fold(score, count, [[1, 1], [1, 2]])  # layer 1, head 0: 0.3 vs 0.3000001
    assert first_use.group_differs("accumulated", got, want) is None


@pytest.mark.parametrize("change,what", [
    ("victim", "layer 0's victims differ"), ("positions", "positions differ"),
    ("count", "counts differ"), ("score", "scores differ")])
def test_real_differences_are_named(change, what):
    score, count = state()
    want = fold(score, count, [[1, 1], [0, 2]])
    victims = [[2, 1], [0, 2]] if change == "victim" else [[1, 1], [0, 2]]
    pos = np.arange(score.size).reshape(score.shape)
    if change == "positions":
        pos[0, 0, 0] = 99
    got = fold(score * (1.01 if change == "score" else 1.0),
               count + (change == "count"), victims, pos)
    assert first_use.group_differs("accumulated", got, want) == what


def test_normalized_mode_ranks_by_score_per_count():
    """Under 'normalized' the tie is judged on score / count: 0.3 / 1 against
    0.6 / 2 is a tie, against 0.6 / 1 it is not."""
    score, count = state()
    score[1, 0, 1], count[1, 0, 1] = 0.6, 2.0
    want = fold(score, count, [[1, 1], [0, 2]])
    got = fold(score, count, [[1, 1], [1, 2]])
    assert first_use.group_differs("normalized", got, want) is None
    count[1, 0, 1] = 1.0
    want, got = fold(score, count, [[1, 1], [0, 2]]), fold(score, count, [[1, 1], [1, 2]])
    assert first_use.group_differs("normalized", got, want) == "layer 1's victims differ"


def test_queue_folds_agree_on_counts_and_near_scores():
    score = mx.array(np.array([[[1.0, 2.0, 3.0]]], np.float32))
    count = mx.array(np.array([[[1.0, 1.0, 2.0]]], np.float32))
    assert first_use.queue_differs((score * (1 + 1e-6), count), (score, count)) is None
    assert first_use.queue_differs((score * 1.01, count), (score, count)) == "scores differ"
    assert first_use.queue_differs((score, count + 1), (score, count)) == "counts differ"


def test_off_metal_nothing_is_checked(monkeypatch):
    monkeypatch.setattr(first_use, "_PASSED", {})
    for backend in (None, "cuda"):
        monkeypatch.setattr(first_use, "device_backend", lambda b=backend: b)
        assert not first_use.needs_check("group fold dense")
        assert first_use.passed("group fold dense")
    monkeypatch.setattr(first_use, "device_backend", lambda: "metal")
    assert first_use.needs_check("group fold dense")


def test_a_failed_check_warns_and_returns_the_reference(monkeypatch):
    monkeypatch.setattr(first_use, "_PASSED", {})
    want = (mx.array([1.0]), mx.array([1.0]))
    got = (mx.array([2.0]), mx.array([1.0]))
    with pytest.warns(RuntimeWarning, match="Metal queue fold failed its first-use check "
                                            r"\(scores differ\)"):
        res = first_use.checked("queue fold", lambda: got, lambda: want,
                                first_use.queue_differs)
    assert res is want and not first_use.passed("queue fold")

    def broken():
        raise RuntimeError("does not build")

    with pytest.warns(RuntimeWarning, match="RuntimeError: does not build"):
        assert first_use.checked("group fold dense", broken, lambda: want,
                                 first_use.queue_differs) is want
    assert first_use.checked("other", lambda: want, lambda: want,
                             first_use.queue_differs) is want and first_use.passed("other")


def test_no_reference_means_no_verdict_yet(monkeypatch):
    """Where the reference cannot be evaluated, the kernel's result serves
    unchecked and the next call checks again."""
    monkeypatch.setattr(first_use, "_PASSED", {})
    monkeypatch.setattr(first_use, "device_backend", lambda: "metal")
    got = (mx.array([2.0]), mx.array([1.0]))

    def no_reference():
        raise ValueError("cannot evaluate here")

    assert first_use.checked("queue fold", lambda: got, no_reference,
                             first_use.queue_differs) is got
    assert first_use.needs_check("queue fold")


def test_fused_steps_agree_on_outputs_within_their_dtype():
    from mlx_h2o.kernels import H2OStep

    score, count = state()
    want_fold = fold(score, count, [[1, 1], [0, 2]])
    # One layer of B=2 (the two rows), victims repeated along D=4 as the kernel's.
    victim = mx.broadcast_to(want_fold[3], (2, 2, 1, 4))
    out = mx.array(np.linspace(-1, 1, 2 * 4 * 8, dtype=np.float32).reshape(2, 4, 1, 8))

    def step(o, v=victim):
        return H2OStep(o.astype(mx.float16), *want_fold[:3], v, None, None)

    want = step(out)
    assert first_use.step_differs("accumulated", step(out * (1 + 2.0 ** -12)), want) is None
    assert first_use.step_differs("accumulated", step(out * 1.01), want) == "outputs differ"
    moved = mx.broadcast_to(mx.array([[[[2]], [[1]]], [[[0]], [[2]]]], mx.int32), (2, 2, 1, 4))
    assert (first_use.step_differs("accumulated", step(out, moved), want)
            == "layer 0's victims differ")
