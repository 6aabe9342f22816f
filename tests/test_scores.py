"""The score-mode registry (mlx_h2o/scores.py) against every reader of it.

Each reader derives its mode names from the registry; what cannot be derived
(the kernels' FOLD branches, the Swift enum) is checked here against it, so a
new entry that says ``kernel=True`` fails these tests until the kernels and the
Swift twin handle it. Entries with ``kernel=False`` run on the reference decode
paths only (policy.fold_scores, and the Swift core's fold).
"""

import dataclasses
import os
import re

import pytest

import mlx_h2o
from mlx_h2o import config, policy, scores
from mlx_h2o.kernels import build
from mlx_h2o.kernels import source as src
from mlx_h2o.scores import DEFERRABLE, KERNEL_MODES, SCORE_MODES, SCORES

ROOT = os.path.join(os.path.dirname(__file__), "..")
SWIFT_CONFIG = os.path.join(ROOT, "swift", "Sources", "H2OCore", "H2OConfig.swift")


def _mode_ids(pattern: str) -> set:
    """The ids of a ``MODE == a || MODE == b`` condition of the kernels' FOLD."""
    found = re.search(pattern, src.FOLD)
    assert found, f"FOLD no longer has {pattern!r}: update this parse with the kernel"
    cond = found.group(1).strip()
    assert re.fullmatch(r"MODE == \d+( \|\| MODE == \d+)*", cond), cond
    return {int(i) for i in re.findall(r"\d+", cond)}


def kernel_fold(kernel_id: int) -> tuple:
    """(fold, magnitude, rank) that FOLD computes for ``MODE == kernel_id``."""
    ema = _mode_ids(r"if \(([^)]*)\) \{\s*// EMA")
    abs_logit = _mode_ids(r"mag \+= ([^?]*)\?\s*\(vis \? H2O_FABS")  # inside the EMA branch
    per_query = _mode_ids(r"const float es = ([^?]*)\? sc / H2O_FMAX\(cn")
    if kernel_id in ema:
        fold, magnitude = "ema", "abs_logit" if kernel_id in abs_logit else "probability"
    else:
        fold, magnitude = "sum", "probability"  # the sum branch adds probabilities
    return fold, magnitude, "per_query" if kernel_id in per_query else "score"


@pytest.mark.parametrize("mode", KERNEL_MODES)
def test_kernel_fold_handles_the_mode_as_the_registry_says(mode):
    m = SCORES[mode]
    assert kernel_fold(m.kernel_id) == (m.fold, m.magnitude, m.rank), (
        f"kernels/source.py FOLD does not compute {mode!r} for MODE == {m.kernel_id}")


def test_kernel_ids_index_the_kernels_mode_list():
    # Swift's MetalH2OStep takes MODE as the index in KernelConstants.scoreModes.
    assert sorted(m.kernel_id for m in SCORES.values()) == list(range(len(SCORES)))
    assert [SCORES[n].kernel_id for n in build.SCORE_MODES] == list(range(len(SCORES)))
    named = set().union(*(_mode_ids(p) for p in (
        r"if \(([^)]*)\) \{\s*// EMA", r"const float es = ([^?]*)\? sc / H2O_FMAX\(cn")))
    kernel_ids = {m.kernel_id for m in SCORES.values() if m.kernel}
    assert named <= kernel_ids, "FOLD branches on an id no kernel mode has"


def test_kernel_modes_come_first():
    # A mode without a kernel reserves the next MODE id: the kernel modes keep
    # ids 0..k-1, the ones Swift's KernelConstants.scoreModes indexes.
    ids = sorted(SCORES[n].kernel_id for n in KERNEL_MODES)
    assert ids == list(range(len(KERNEL_MODES)))
    assert KERNEL_MODES == tuple(n for n in SCORE_MODES if SCORES[n].kernel)
    for n in set(SCORE_MODES) - set(KERNEL_MODES):
        assert not SCORES[n].deferrable, f"{n}: the queue fold is a GPU kernel too"


@pytest.mark.parametrize("mode", SCORE_MODES)
def test_only_sums_of_probabilities_are_deferrable(mode):
    m = SCORES[mode]
    assert (mode in DEFERRABLE) == m.deferrable
    if m.deferrable:  # kernels/queued.py adds each query's probability
        assert (m.fold, m.magnitude) == ("sum", "probability")
    with pytest.raises(ValueError, match="deferrable"):
        dataclasses.replace(m, fold="ema", deferrable=True)


def test_entries_are_validated():
    m = SCORES["accumulated"]
    for bad in (dict(fold="mean"), dict(magnitude="logit"), dict(rank="count"),
                dict(kernel_id=-1), dict(kernel=1)):
        with pytest.raises(ValueError, match="score mode 'accumulated'"):
            dataclasses.replace(m, **bad)
    for bad in (dict(fold="fixed"), dict(magnitude="key_norm", kernel=False)):
        with pytest.raises(ValueError, match="fold 'fixed' goes with magnitude 'key_norm'"):
            dataclasses.replace(SCORES["ema"], **bad)
    with pytest.raises(ValueError, match="no key-norm branch"):
        dataclasses.replace(SCORES["key_norm"], kernel=True)
    with pytest.raises(ValueError, match="prefill='chunk'"):
        dataclasses.replace(m, prefill="chunk")
    for bad in (dict(fold="ema", deferrable=False), dict(magnitude="abs_logit")):
        with pytest.raises(ValueError, match="prefill 'expected' adds expected"):
            dataclasses.replace(SCORES["expected_attention"], **bad)
    with pytest.raises(ValueError, match="share a name"):
        scores._registry(m, m)
    with pytest.raises(ValueError, match="share a kernel_id"):
        scores._registry(m, dataclasses.replace(m, name="x", short="x"))


def test_every_reader_takes_the_registry_names():
    assert config.SCORE_MODES is SCORE_MODES and mlx_h2o.SCORE_MODES is SCORE_MODES
    assert set(build.SCORE_MODES) == set(SCORE_MODES)
    for mode in SCORE_MODES:
        assert config.H2OConfig(max_size=16, score=mode).score == mode
    with pytest.raises(ValueError, match=re.escape(str(SCORE_MODES))):
        config.H2OConfig(max_size=16, score="bogus")
    with pytest.raises(ValueError, match=re.escape(str(SCORE_MODES))):
        policy.eviction_score("bogus", None, None)


@pytest.mark.parametrize("mode", SCORE_MODES)
def test_short_name_is_a_strategy_suffix(mode):
    from mlx_h2o.eval.strategies import parse_strategy

    strategy = parse_strategy(f"h2o-heavy-{SCORES[mode].short}")
    assert strategy.h2o_config(256).score == mode


def test_swift_score_mode_enum_matches_the_registry():
    """H2OCore's ScoreMode: its raw values, then its ``pythonOnly`` names (modes
    it refuses by name), are the registry's names in order: the unknown-mode
    error lists them as Python's does (config_cases vectors). The cases it has
    it folds as policy.fold_scores does; it refuses the modes that need more
    than logits (ScoreMode.from_logits): key-norm's keys, expected
    attention's queries, which its slots never see."""
    with open(SWIFT_CONFIG) as f:
        text = f.read()
    body = re.search(r"public enum ScoreMode\b[^{]*\{(.*?)\n\s*public init", text, re.S)
    assert body, "ScoreMode enum not found in H2OConfig.swift"
    cases = re.findall(r'^\s*case (\w+)(?:\s*=\s*"([^"]*)")?\s*$', body.group(1), re.M)
    only = re.search(r"static let pythonOnly = \[([^\]]*)\]", body.group(1))
    assert only, "ScoreMode.pythonOnly not found in H2OConfig.swift"
    refused = tuple(re.findall(r'"([^"]*)"', only.group(1)))
    assert tuple(raw or name for name, raw in cases) + refused == SCORE_MODES
    assert refused == tuple(n for n in SCORE_MODES if not SCORES[n].from_logits)
