"""H2OConfig / QuantConfig / window_size: every field's wrong type and bad value
is refused with an error naming the field; budgets left unset are derived."""

import math
from dataclasses import fields

import pytest

from mlx_h2o.cache.quantized import QuantConfig
from mlx_h2o.config import H2OConfig, check_window_size, config_from_dict
from mlx_h2o.kernels.quantized_reference import BITS, GROUP_SIZES

BASE = {"max_size": 64}  # heavy 30, recent 30 when derived

# Per H2OConfig field: (value, error) pairs a user could plausibly write.
# Every field needs an entry: a new field without one fails test_every_field_is_covered.
BAD = {
    "max_size": [
        (0, ValueError),
        (-3, ValueError),
        ("64", TypeError),
        (True, TypeError),
        (2.5, TypeError),
        (None, TypeError),
    ],
    "sink_size": [
        (-1, ValueError),
        (64, ValueError),
        ("4", TypeError),
        (True, TypeError),
    ],
    "heavy_budget": [
        (-1, ValueError),
        (60, ValueError),
        ("4", TypeError),
        (False, TypeError),
    ],
    "recent_budget": [
        (0, ValueError),
        (61, ValueError),
        (4.0, TypeError),
        (True, TypeError),
    ],
    "score": [("magic", ValueError), (1, TypeError), (None, TypeError)],
    "ema_alpha": [
        (1.0, ValueError),
        (0, ValueError),
        (math.nan, ValueError),
        (None, TypeError),
        ("x", TypeError),
        (True, TypeError),
    ],
    "pinned": [
        (((5, 3),), ValueError),
        (((-2, 3),), ValueError),
        (((0, 40),), ValueError),
        (((1, 5), (4, 6)), ValueError),
        (None, TypeError),
        ((1, 2), TypeError),
        (((True, 3),), TypeError),
        (((1.0, 3),), TypeError),
        (((1, 2, 3),), TypeError),
    ],
    "step": [(0, ValueError), ("256", TypeError)],
    "prefill_window": [(-1, ValueError), (2.0, TypeError)],
    "prefill_pool": [(-1, ValueError), (None, TypeError)],
    "prefill_compact": [("never", ValueError), (None, TypeError)],
    "evict_batch": [(0, ValueError), (31, ValueError), (True, TypeError)],
}
CASES = [(name, value, error) for name, cases in BAD.items() for value, error in cases]


def test_every_field_is_covered():
    assert set(BAD) == {f.name for f in fields(H2OConfig)}


@pytest.mark.parametrize("name", [f.name for f in fields(H2OConfig)])
def test_wrong_type_names_the_field(name):
    with pytest.raises(TypeError, match=name):
        H2OConfig(**{**BASE, name: object()})


@pytest.mark.parametrize("name,value,error", CASES)
def test_bad_value_names_the_field_and_value(name, value, error):
    with pytest.raises(error) as info:
        H2OConfig(**{**BASE, name: value})
    msg = str(info.value)
    assert name in msg
    if error is ValueError:
        shown = repr(value[0]) if name == "pinned" else str(value)
        assert shown in msg, "the message shows the value"
        assert ":" in msg or ";" in msg, "the message says what to do"


@pytest.mark.parametrize(
    "kwargs,heavy,recent",
    [
        (
            dict(max_size=2, sink_size=1),
            0,
            1,
        ),  # the derived split once left recent empty
        (dict(max_size=1, sink_size=0), 0, 1),
        (dict(max_size=3, sink_size=1), 1, 1),
        (dict(max_size=256), 126, 126),  # unchanged where the rest is >= 2
        (dict(max_size=10, sink_size=2, heavy_budget=7), 7, 1),
        (dict(max_size=10, sink_size=2, recent_budget=8), 0, 8),
    ],
)
def test_unset_budgets_are_derived(kwargs, heavy, recent):
    cfg = H2OConfig(**kwargs)
    assert (cfg.heavy_budget, cfg.recent_budget) == (heavy, recent)
    assert cfg.sink_size + heavy + recent == cfg.max_size


def test_pinned_is_normalised():
    cfg = H2OConfig(max_size=64, pinned=[[8, 10], (0, 2)])
    assert cfg.pinned == ((0, 2), (8, 10)) and hash(cfg)


def test_config_from_dict_refuses_non_dicts():
    with pytest.raises(TypeError, match="dict"):
        config_from_dict([("max_size", 8)])
    with pytest.raises(TypeError, match="pinned"):
        config_from_dict({"max_size": 8, "pinned": 3})


@pytest.mark.parametrize(
    "value,error",
    [
        ("8", TypeError),
        (2.5, TypeError),
        (True, TypeError),
        (None, None),
        (0, ValueError),
        (-4, ValueError),
    ],
)
def test_check_window_size(value, error):
    if error is None:
        assert check_window_size(value) is None
        assert check_window_size(8) == 8
        return
    with pytest.raises(error, match="window_size"):
        check_window_size(value)


# --- QuantConfig ----------------------------------------------------------------------
QUANT_BAD = {
    "bits": [
        (3, ValueError),
        (16, ValueError),
        (8.0, TypeError),
        ("8", TypeError),
        (True, TypeError),
    ],
    "group_size": [(16, ValueError), (64.0, TypeError), (None, TypeError)],
    "recent_bits": [
        (3, ValueError),
        (8, ValueError),
        (4.0, TypeError),
        (False, TypeError),
    ],
}


def test_every_quant_field_is_covered():
    assert set(QUANT_BAD) == {f.name for f in fields(QuantConfig)}


@pytest.mark.parametrize("name", [f.name for f in fields(QuantConfig)])
def test_quant_wrong_type_names_the_field(name):
    with pytest.raises(TypeError, match=name):
        QuantConfig(**{name: object()})


@pytest.mark.parametrize(
    "name,value,error", [(n, v, e) for n, cases in QUANT_BAD.items() for v, e in cases]
)
def test_quant_bad_value_names_the_field(name, value, error):
    with pytest.raises(error, match=name):
        QuantConfig(**{name: value})


def test_quant_accepts_exactly_the_kernels_widths():
    """The widths the quantized kernels read (tests/test_quantized_kernel.py
    runs 2, 4 and 8; a uint32 holds 32 / bits whole values)."""
    assert BITS == (2, 4, 8)
    ok = {b for b in range(1, 33) if _accepts(bits=b)}
    assert ok == set(BITS)
    assert {
        g for g in (8, 16, 32, 48, 64, 96, 128, 256) if _accepts(group_size=g)
    } == set(GROUP_SIZES)
    assert {r for r in range(1, 9) if _accepts(bits=8, recent_bits=r)} == {2, 4}


def _accepts(**kw) -> bool:
    try:
        QuantConfig(**kw)
    except ValueError:
        return False
    return True
