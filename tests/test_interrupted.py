"""A forward pass interrupted between a layer's cache update and its attention
(an exception or Ctrl-C inside the model) leaves the cache usable: the next
call says what happened and recover_prompt_cache puts every layer right."""

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import make_prompt_cache

import mlx_h2o
from mlx_h2o import H2OConfig, make_h2o_cache, recover_prompt_cache

from test_cache import check_kept
from tiny_models import VOCAB, tiny_llama, tiny_qwen3

TOKENS = mx.array(np.random.default_rng(0).integers(0, VOCAB, (1, 48)))


def interrupt_once(cache):
    """The layer's next attention raises KeyboardInterrupt, once."""
    attend = cache.h2o_attention

    def stop(*args, **kwargs):
        cache.h2o_attention = attend
        raise KeyboardInterrupt

    cache.h2o_attention = stop


def forward(model, cache, start, stop):
    if start == stop:
        return None
    with mlx_h2o.patch():
        return model(TOKENS[:, start:stop], cache=cache)


@pytest.mark.parametrize("layer", [0, 1, 2])
@pytest.mark.parametrize("chunk", [(0, 20), (20, 21)])  # a prompt chunk, a decode step
def test_recovered_cache_goes_on_as_if_never_interrupted(layer, chunk):
    model = tiny_llama(num_hidden_layers=3)
    cfg = H2OConfig(max_size=64)  # never exceeded: exact against an uninterrupted run
    start, stop = chunk
    want = make_h2o_cache(model, cfg, layer_budget="uniform")
    forward(model, want, 0, start)
    want = [forward(model, want, start, stop), forward(model, want, stop, stop + 1)]

    cache = make_h2o_cache(model, cfg, layer_budget="uniform")
    forward(model, cache, 0, start)
    interrupt_once(cache[layer])
    with pytest.raises(KeyboardInterrupt):
        forward(model, cache, start, stop)
    with pytest.raises(RuntimeError, match="recover_prompt_cache"):
        forward(model, cache, start, stop)
    assert recover_prompt_cache(cache) == start
    assert {c.offset for c in cache} == {start}
    got = [forward(model, cache, start, stop), forward(model, cache, stop, stop + 1)]
    for a, b in zip(got, want):
        np.testing.assert_array_equal(np.array(a), np.array(b))


def test_recovery_of_an_evicting_cache_keeps_its_invariants():
    model = tiny_qwen3(num_hidden_layers=3)
    cfg = H2OConfig(max_size=12, sink_size=2, heavy_budget=4)
    cache = make_h2o_cache(model, cfg, layer_budget="uniform")
    forward(model, cache, 0, 30)
    for t in range(30, 36):
        forward(model, cache, t, t + 1)
    interrupt_once(cache[1])
    with pytest.raises(KeyboardInterrupt):
        forward(model, cache, 36, 37)
    assert recover_prompt_cache(cache) == 36
    for t in range(36, 44):
        forward(model, cache, t, t + 1)
    for c in cache:
        check_kept(c, 44, cfg)


def test_nothing_interrupted_is_a_no_op():
    model = tiny_llama()
    for cache in (make_h2o_cache(model, H2OConfig(max_size=8)), make_prompt_cache(model)):
        forward(model, cache, 0, 12)
        assert recover_prompt_cache(cache) == 12 and {c.offset for c in cache} == {12}


def test_without_routing_the_error_names_routing():
    model = tiny_llama()
    cache = make_h2o_cache(model, H2OConfig(max_size=8))
    model(TOKENS[:, :4], cache=cache)  # not patched: attention bypasses the cache
    with pytest.raises(RuntimeError, match="mlx_h2o.patch"):
        model(TOKENS[:, 4:5], cache=cache)
