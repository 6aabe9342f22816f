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


def test_attentions_agree_within_rounding_and_name_what_differs():
    rng = np.random.default_rng(0)
    out = mx.array(rng.standard_normal((1, 4, 1, 8)).astype(np.float32)).astype(mx.float16)
    logits = rng.standard_normal((1, 4, 1, 5)).astype(np.float32)
    logits[..., 2] = -np.inf  # a masked key
    lse = mx.array(rng.standard_normal((1, 4, 1)).astype(np.float32))
    want = (out, mx.array(logits), lse)
    near = (out, mx.array(logits * (1 + 1e-6)), lse)
    assert first_use.attention_differs(near, want) is None
    assert first_use.attention_differs((out * 1.01, *want[1:]), want) == "out differs"
    assert (first_use.attention_differs((out, mx.array(logits * 1.001), lse), want)
            == "logits differs")
    unmasked = np.where(np.isfinite(logits), logits, 0.0)
    assert (first_use.attention_differs((out, mx.array(unmasked), lse), want)
            == "logits differs (shape or masked entries)")


def test_written_marks_each_rows_slot():
    index = mx.array(np.array([[2, 0]], np.int32).reshape(1, 2, 1, 1))
    rows = first_use.written(mx.broadcast_to(index, (1, 2, 1, 4)), 3)
    assert rows.shape == (1, 2, 3, 1)
    assert rows[..., 0].tolist() == [[[False, False, True], [True, False, False]]]


def triple(codes, scales, biases, bits=8):
    """A (words, scales, biases) triple of mx arrays from numpy codes."""
    per = 32 // bits
    shifted = codes.astype(np.uint64).reshape(*codes.shape[:-1], -1, per) << (
        np.arange(per, dtype=np.uint64) * bits)
    words = shifted.sum(-1).astype(np.uint32)
    return (mx.array(words), mx.array(scales).astype(mx.float16),
            mx.array(biases).astype(mx.float16))


def quantized_state(seed=0, D=64, gs=32, cap=4):
    """Stored K and V triples of B=1, Hk=2, ``cap`` slots, 8-bit codes in
    1..254 (room for one step either way), and the slots written (2, 0)."""
    rng = np.random.default_rng(seed)
    codes = [rng.integers(1, 255, (1, 2, cap, D)) for _ in range(2)]
    scales = [rng.uniform(0.01, 0.1, (1, 2, cap, D // gs)).astype(np.float32) for _ in range(2)]
    biases = [rng.uniform(-1, 1, (1, 2, cap, D // gs)).astype(np.float32) for _ in range(2)]
    index = mx.array(np.array([2, 0], np.int32).reshape(1, 2, 1, 1))
    return codes, scales, biases, first_use.written(index, cap)


def write_verdict(codes, scales, biases, rows, change, dense=None):
    """quantized_write_differs of the state with ``change(key_codes)`` applied
    to a copy of the keys' codes."""
    want = [triple(c, s, b) for c, s, b in zip(codes, scales, biases)]
    changed = change(codes[0].copy())
    got = [triple(changed, scales[0], biases[0]), want[1]]
    return first_use.quantized_write_differs(8, 32, rows, got, want, dense=dense)


def test_quantized_writes_agree_up_to_ties_in_the_written_slots():
    codes, scales, biases, rows = quantized_state()

    def bump(slot, head, n, by=1):
        def change(c):
            c[0, head, slot, :n] += by
            return c
        return change

    assert write_verdict(codes, scales, biases, rows, lambda c: c) is None
    assert write_verdict(codes, scales, biases, rows, bump(2, 0, 3)) is None  # ties
    assert write_verdict(codes, scales, biases, rows, bump(2, 0, 1, by=2)) == "written keys differ"
    assert (write_verdict(codes, scales, biases, rows, bump(2, 0, 40))
            == "written keys differ (more than ties)")
    assert (write_verdict(codes, scales, biases, rows, bump(1, 0, 1))
            == "keys outside the written slots differ")


def test_a_packed_writes_dense_keys_must_match_its_triples():
    codes, scales, biases, rows = quantized_state()
    deq = [first_use._dequantized(tuple(np.array(a.astype(mx.float32)) if a.dtype != mx.uint32
                                        else np.array(a) for a in triple(c, s, b)), 8, 32)
           for c, s, b in zip(codes, scales, biases)]
    dense = [mx.array(d).astype(mx.float16) for d in deq]
    assert write_verdict(codes, scales, biases, rows, lambda c: c, dense=dense) is None
    off = [dense[0] * 1.01, dense[1]]
    assert (write_verdict(codes, scales, biases, rows, lambda c: c, dense=off)
            == "dense keys differ from the written ones")
