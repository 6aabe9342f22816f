"""The first-use check that gates kernels never run on their backend (Metal)."""

import mlx.core as mx
import pytest

from mlx_h2o.kernels import backend, build, decode, reference, selfcheck


def by_reference(q, k, v, *, scale, mask, sinks, num_splits):
    return reference.scaled_dot_product_attention_with_scores(
        q, k, v, scale=scale, mask=mask, sinks=sinks)


def test_a_correct_attention_passes():
    assert selfcheck.check_attention(by_reference, mx.cpu) is None
    assert selfcheck.kernels_pass(by_reference, mx.cpu)


@pytest.mark.parametrize("which, change", [
    (0, lambda x: x + 1e-3 * mx.abs(x).max()),  # out slightly off
    (1, lambda x: mx.where(mx.isinf(x), 0.0, x)),  # a masked logit made visible
    (2, lambda x: x * float("nan")),  # lse NaN
])
def test_a_wrong_output_fails(which, change):
    def attend(*args, **kwargs):
        outs = list(by_reference(*args, **kwargs))
        outs[which] = change(outs[which])
        return tuple(outs)

    name = ("out", "logits", "lse")[which]
    assert selfcheck.check_attention(attend, mx.cpu).startswith(name)
    with pytest.warns(RuntimeWarning, match="first-use check"):
        assert not selfcheck.kernels_pass(attend, mx.cpu)


def test_only_the_split_path_wrong_fails():
    def attend(*args, num_splits, **kwargs):
        out, logits, lse = by_reference(*args, num_splits=num_splits, **kwargs)
        return (out * 1.01 if num_splits > 1 else out), logits, lse

    assert selfcheck.check_attention(attend, mx.cpu) == (
        "out differs from the reference with 3 split(s)")


def test_a_kernel_that_does_not_build_fails():
    def attend(*args, **kwargs):
        raise RuntimeError("[metal::Device] Unable to build metal library from source")

    with pytest.warns(RuntimeWarning, match="Unable to build"):
        assert not selfcheck.kernels_pass(attend, mx.cpu)


@pytest.mark.parametrize("device, passes, want", [
    ("metal", True, "metal"), ("metal", False, None), ("cuda", False, "cuda"), (None, True, None),
])
def test_gpu_backend_uses_metal_only_after_the_check(monkeypatch, device, passes, want):
    checked = []

    def fake_pass():
        checked.append(device)
        return passes

    monkeypatch.setattr(backend, "device_backend", lambda: device)
    monkeypatch.setattr(selfcheck, "kernels_pass", fake_pass)
    backend.gpu_backend.cache_clear()
    try:
        assert backend.gpu_backend() == want
        assert backend.gpu_backend() == want
        assert checked == (["metal"] if device == "metal" else [])  # once, Metal only
    finally:
        backend.gpu_backend.cache_clear()


@pytest.mark.skipif(build.device_backend() is None,
                    reason="needs MLX with Metal or CUDA (mx.metal / mx.cuda unavailable)")
def test_the_kernels_of_this_backend_pass():
    """No false alarm: the real kernels pass the check that gates Metal's."""
    assert selfcheck.check_attention(decode.decode_attention) is None


def test_its_error_is_the_kernel_checks_rel_err():
    """selfcheck._rel_err is testing.rel_err (numpy, tests and scripts) in mx ops."""
    import numpy as np

    from kernel_refs import rel_err

    ref = mx.random.normal((2, 3, 40))
    ref = mx.where(mx.random.uniform(shape=ref.shape) < 0.2, -mx.inf, ref)
    close = ref + 1e-5 * mx.random.normal(ref.shape)
    flipped = mx.where(mx.isinf(ref), mx.inf, close)  # +inf where the reference has -inf
    for got in (ref, close, flipped, close * float("nan"), mx.zeros_like(ref)):
        want = rel_err(np.array(got, np.float64), np.array(ref, np.float64))
        assert selfcheck._rel_err(got, ref) == pytest.approx(want, rel=1e-4)
