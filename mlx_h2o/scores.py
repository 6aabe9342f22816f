"""Score modes: how a slot's score folds each attention call and ranks it.

One entry per mode; everything else reads it: ``H2OConfig.score`` takes its
names (``SCORE_MODES``), ``policy.fold_scores`` / ``eviction_score`` its fold
and rank, the kernels its ``kernel_id`` (their ``MODE`` template constant,
``kernels/source.py``'s ``FOLD``) where ``kernel`` is True, the deferred queue fold its ``deferrable``
modes and the evaluation's strategy names its ``short`` names. A new mode is
one entry here; a new (fold, magnitude, rank) combination also needs its branch
in ``policy.fold_scores``, and in the kernels' ``FOLD`` before its entry may say
``kernel=True``. A mode with ``kernel=False`` runs on the op-by-op and compiled
CPU decode paths only (``policy.fold_scores``): no GPU path may take it.
A mode whose magnitude is ``key_norm`` scores a slot from its key when the key
is written (``policy.written_score``, at every metadata write of the caches)
and its ``fold`` is "fixed": attention never changes the score.
A mode whose ``prefill`` is "expected" scores a prompt chunk that overflows
the budget by the attention a Gaussian fitted to its window's queries
expects (``policy.expected_logits``), not by the window's own attention.

Every mode keeps one score per (sequence, KV head, slot): the query heads of a
GQA group are averaged, and ``count`` is the number of queries that could see
the key. Stdlib only: the kernels read it too.
"""

from dataclasses import dataclass
from types import MappingProxyType
from typing import Mapping, Tuple

# s += step | s = alpha * s + (1 - alpha) * mean step | s = mean step (this call's only)
# | s as written (attention never changes it)
FOLDS = ("sum", "ema", "last", "fixed")
# softmax attention | |logit| of visible keys | -||k||_2 of the key, set when written
MAGNITUDES = ("probability", "abs_logit", "key_norm")
RANKS = ("score", "per_query")  # s | s / max(count, 1)
# How an overflowing prompt chunk is scored: its last prefill_window queries'
# attention | the attention expected from a Gaussian fitted to those queries
PREFILLS = ("window", "expected")


@dataclass(frozen=True)
class ScoreMode:
    """A score mode: its fold over attention calls and its eviction ranking.

    ``fold`` "sum" adds each call's magnitude, summed over its queries;
    "ema" folds each call's mean over the queries that saw the key into an
    EMA (``alpha``: ``H2OConfig.ema_alpha``; the first sight sets it);
    "last" replaces the score by the call's mean over the queries that saw
    the key (keys no query of the call saw keep theirs); "fixed" keeps the
    score a slot was written with (magnitude "key_norm" only).
    ``magnitude`` is what a query contributes to a key (for "key_norm": what
    the key itself gives, once, when it is written). ``rank`` is the
    number eviction compares: the score, or the score per query that saw the
    key. ``kernel_id``: the kernels' ``MODE`` constant; ``kernel``: whether
    the kernels' ``FOLD`` computes the mode (False: ``kernel_id`` is only
    reserved, and decode must take the op-by-op / compiled CPU path, which
    folds by ``policy.fold_scores``). ``deferrable``: the
    fold is a plain sum of probabilities over queries, so the batched queue
    fold (``cache/decode/deferred.py``, ``kernels/queued.py``) may fold it.
    """

    name: str
    short: str  # strategy-name suffix of the evaluation (``h2o-heavy-<short>``)
    fold: str
    magnitude: str
    rank: str
    kernel_id: int
    deferrable: bool
    description: str  # the paper it comes from and its exact normalisation
    kernel: bool = True
    prefill: str = "window"

    def __post_init__(self):
        for field, value, choices in (("fold", self.fold, FOLDS),
                                      ("magnitude", self.magnitude, MAGNITUDES),
                                      ("rank", self.rank, RANKS),
                                      ("prefill", self.prefill, PREFILLS)):
            if value not in choices:
                raise ValueError(f"score mode {self.name!r}: {field}={value!r}; "
                                 f"use one of {choices}")
        if not isinstance(self.kernel_id, int) or self.kernel_id < 0:
            raise ValueError(f"score mode {self.name!r}: kernel_id must be an int >= 0")
        if not isinstance(self.kernel, bool):
            raise ValueError(f"score mode {self.name!r}: kernel must be True or False")
        if self.deferrable and (self.fold, self.magnitude) != ("sum", "probability"):
            raise ValueError(f"score mode {self.name!r}: only a sum of probabilities is "
                             "deferrable (the queue fold adds probabilities)")
        if (self.fold == "fixed") != (self.magnitude == "key_norm"):
            raise ValueError(f"score mode {self.name!r}: fold 'fixed' goes with magnitude "
                             "'key_norm' (a score set from the key when it is written)")
        if self.magnitude == "key_norm" and self.kernel:
            raise ValueError(f"score mode {self.name!r}: the kernels have no key-norm "
                             "branch; use kernel=False")
        summed = (self.fold, self.magnitude) == ("sum", "probability")
        if self.prefill == "expected" and not summed:
            raise ValueError(f"score mode {self.name!r}: prefill 'expected' adds "
                             "expected probabilities; use fold 'sum', magnitude "
                             "'probability'")

    @property
    def from_keys(self) -> bool:
        """The score is set from the key when it is written, never by attention."""
        return self.magnitude == "key_norm"

    @property
    def from_logits(self) -> bool:
        """Every score comes from the logits attention exports (all the Swift
        core's slots see): not from keys, nor from a chunk's queries."""
        return not self.from_keys and self.prefill == "window"


def _registry(*modes: ScoreMode) -> Mapping[str, ScoreMode]:
    for attr in ("name", "short", "kernel_id"):
        values = [getattr(m, attr) for m in modes]
        if len(set(values)) != len(values):
            raise ValueError(f"score modes share a {attr}: {values}")
    return MappingProxyType({m.name: m for m in modes})


SCORES: Mapping[str, ScoreMode] = _registry(
    ScoreMode(
        "ema", "ema", "ema", "abs_logit", "score", kernel_id=0, deferrable=False,
        description="H2O-in-MLX paper: s = alpha * s + (1 - alpha) * mean over the "
        "call's visible queries of the group-mean |logit|; ranked by s."),
    ScoreMode(
        "accumulated", "acc", "sum", "probability", "score", kernel_id=1, deferrable=True,
        description="H2O (Zhang et al. 2023): s = sum over all queries of the "
        "group-mean softmax attention; ranked by s (older keys have more terms)."),
    ScoreMode(
        "normalized", "norm", "sum", "probability", "per_query", kernel_id=2,
        deferrable=True,
        description="H2O's accumulated attention (Zhang et al. 2023) per query that "
        "could see the key: ranked by s / max(count, 1), no age bias."),
    ScoreMode(
        "attention_ema", "aema", "ema", "probability", "score", kernel_id=3,
        deferrable=False,
        description="The H2O-in-MLX paper's EMA with softmax attention for |logit| "
        "(a strongly negative logit is no reason to keep a key); ranked by s."),
    ScoreMode(
        "tova", "tova", "last", "probability", "score", kernel_id=4, deferrable=False,
        kernel=False,
        description="TOVA (Oren et al. 2024, 'Transformers are Multi-State RNNs'): "
        "s = the latest call's group-mean softmax attention, averaged over that "
        "call's queries that saw the key (decode: the current query's alone; a "
        "prompt chunk: its last prefill_window queries); ranked by s."),
    ScoreMode(
        "key_norm", "knorm", "fixed", "key_norm", "score", kernel_id=5, deferrable=False,
        kernel=False,
        description="Key norm (Devoto et al. 2024, 'A Simple and Effective L2 "
        "Norm-Based Strategy for KV Cache Compression'; kvpress's KnormPress): "
        "s = -||k||_2 per KV head, k the key as the cache receives it (after RoPE, "
        "before any quantization, float32), set once when the key is written and "
        "never changed by attention; ranked by s, so the largest norm goes first. "
        "prefill_window and prefill_pool do not apply."),
    ScoreMode(
        "expected_attention", "ea", "sum", "probability", "score", kernel_id=6,
        deferrable=False, kernel=False, prefill="expected",
        description="Expected Attention (Devoto et al. 2025, 'Expected Attention: KV "
        "Cache Compression by Estimating Attention from Future Queries Distribution'; "
        "kvpress's ExpectedAttentionPress): a prompt chunk of L > W > 1 tokens "
        "(W = prefill_window) that overflows the budget on a global layer adds "
        "W * p to each slot: p the group-mean softmax, over the keys the chunk's last "
        "query may see (attention sinks a column), of z = s mu.k + s^2 / 2 k^T Sigma k "
        "(s the attention scale), mu and Sigma = (1/W) sum (q - mu)(q - mu)^T the "
        "mean and covariance of the chunk's last W queries per query head (after "
        "RoPE, float32); then max-pooled over prefill_pool positions and compacted "
        "as the window would be. Everything else (decode steps, chunks that fit the "
        "budget or have L <= W, sliding-window layers) as accumulated; ranked by s. "
        "Unlike kvpress: the window's post-RoPE queries, not the whole prompt's "
        "pre-RoPE queries with RoPE averaged over the next 512 positions; no "
        "rescaling by ||v||; no n_sink exclusion (sink_size pins the first tokens)."),
)
SCORE_MODES: Tuple[str, ...] = tuple(SCORES)
DEFERRABLE: Tuple[str, ...] = tuple(n for n, m in SCORES.items() if m.deferrable)
# Modes the GPU kernels fold; the others run on the CPU decode paths only.
KERNEL_MODES: Tuple[str, ...] = tuple(n for n, m in SCORES.items() if m.kernel)


def score_mode(name: str) -> ScoreMode:
    """The registry entry of ``name``; ValueError naming the modes if unknown."""
    try:
        return SCORES[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown score mode {name!r}; use one of {SCORE_MODES}") from None
