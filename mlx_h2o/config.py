"""H2O cache configuration."""

from dataclasses import asdict, dataclass, field, replace
from typing import Any, Dict, Optional, Tuple

from .scores import SCORE_MODES

PREFILL_COMPACT = ("chunk", "prompt", "preview", "two_pass")


@dataclass(frozen=True)
class H2OConfig:
    """Budget split and scoring of an H2O KV cache.

    The cache keeps at most ``max_size`` tokens per layer: the first
    ``sink_size`` positions (attention sinks), the last ``recent_budget``
    positions (recent window) and the ``heavy_budget`` other tokens with the
    highest score (heavy hitters). ``max_size = sink + heavy + recent``.
    Leave ``heavy_budget`` or ``recent_budget`` (or both) as ``None`` to derive
    it: with both unset the remainder is split in half (heavy gets the extra;
    the recent window gets at least 1 slot, so heavy may be 0).

    Every field is checked here: a wrong type raises TypeError, a bad value
    ValueError, each naming the field and the fix.

    ``score`` names a score mode of ``mlx_h2o.scores.SCORES`` (``SCORE_MODES``;
    one score per KV head, mean over the query heads of its group); each entry
    states its fold, its ranking and the paper it comes from. ``ema_alpha`` is
    the EMA modes' alpha.

    ``prefill_window`` > 0 scores a chunk of L > 1 tokens (a prompt) that
    overflows the budget with its last ``prefill_window`` queries only
    (SnapKV, Li et al. 2024): the end of a prompt (a question) tells which of
    its tokens will be needed (``expected_attention``: by ``prefill_window``
    times the attention a Gaussian fitted to those queries expects).
    ``prefill_pool`` > 1 max-pools such a chunk's scores over that many
    neighbouring positions, so the tokens around an attended one (the rest of
    a number, a name) stay with it. Neither applies to ``key_norm``, whose
    scores come from the keys, not from attention.

    ``prefill_compact`` says when a prompt that overflows the budget is
    compacted to ``max_size``:
      - ``"chunk"``: at the end of every prefill chunk that overflows it. A
        prompt longer than the prefill step (mlx-lm's generate: 2048 tokens)
        is then compacted before its end exists, scored by a window of filler;
        later windows replace those scores (below), but what was dropped is
        gone: a needle early in a long document can be lost.
      - ``"prompt"``: the cache grows through the whole prompt (``size()`` is
        above ``max_size`` meanwhile) and is compacted once, at the first
        decode step (L == 1), before its token is written. Cost: the whole
        prompt's K/V until the first decode step, and each chunk attends to
        all of it (its scores block is chunk x tokens so far, not prompt x
        prompt); a stream fed only in chunks, with no decode step, is never
        compacted. Measured in docs/RESULTS.md.
      - ``"preview"`` (the default): as ``"chunk"``, and every chunk
        compacted before the prompt's end arrives is scored by the end's
        queries too, seen ahead: ``mlx_h2o.preview_prompt`` runs the
        prompt's last 128 tokens through the model alone, at their own
        positions, before the prefill (mlx_h2o's generate and
        stream_generate, ``mlx-h2o generate`` / ``chat`` / ``cache_prompt``,
        the server and the evaluation commands call it), and
        each overflowing chunk adds the attention of their last
        ``prefill_window`` queries to its window's. Those queries saw only
        the prompt's end, not the text before it: an approximation of the
        real ones, which take over when the end arrives. Memory as under
        ``"chunk"``; cost: one forward pass of 128 tokens and
        ``prefill_window`` queries' attention over each compacted chunk.
        Without a preview (a cache fed directly) it is ``"chunk"``.
        Measured in docs/RESULTS.md.
      - ``"two_pass"``: as ``"preview"``, with the end's queries taken from
        a first prefill of the whole prompt (into copies of the caches,
        bounded as they are, scored by the read-ahead preview): the real
        queries, computed in a compacted context instead of the end alone.
        The first pass holds what ``"chunk"`` holds, in copies freed before
        the second, so the peak is ``"chunk"``'s plus what the caches held
        before the prompt; cost: the prompt prefilled twice
        (``preview_prompt`` runs the first pass).
    In every mode the newest window decides what stays
    (``policy.window_replaces``): a chunk of L >= ``prefill_window`` that
    overflows the budget while the cache already holds ``max_size`` tokens
    *replaces* every held slot's scores and counts with its own window's
    (earlier chunks' windows, and scores from before the prompt, are
    dropped); a shorter chunk adds to the scores held, so with the previous
    window it still spans at least ``prefill_window`` queries; with
    ``prefill_window=0`` every chunk adds (H2O over all the prompt's
    queries). The first chunk that overflows adds to what the chunks that
    fitted gave, so a prompt prefilled in one chunk is kept exactly as
    under the other mode. Key-norm scores are never replaced.
    ``config_to_dict`` leaves ``prefill_compact`` out when it is ``"chunk"``,
    so saved caches and result keys from before the option read the same.

    Defaults chosen by measurement (docs/RESULTS.md): ``accumulated`` scores
    with a 32-query window and 21-position pooling for prompts that overflow
    the budget (11 positions kept the first digits of a number and lost the
    rest); TOVA matched it on the evaluation set but has no kernel branch,
    key-norm and expected attention kept fewer retrieval answers; the
    ``"preview"`` prompt rule kept 68 of the 72 answers that ``"prompt"``
    keeps at 8K where ``"chunk"`` kept 48, at ``"chunk"``'s memory. The paper's
    ``ema`` of |logit| ranks strongly negative logits as important: +4.1% PPL
    vs +1.0% (SmolLM2, max_kv 256) and 0/10 passkeys.

    ``pinned`` holds half-open position ranges ``(start, end)`` that are never
    evicted; they use heavy-hitter slots.

    ``evict_batch`` > 1: a full cache evicts that many tokens at once (the
    lowest-ranked heavy-hitter candidates, as ``max_size - evict_batch``
    would keep them) and the next decode tokens are appended over them until
    it is full again. Decode steps still attend the evicted tokens not yet
    overwritten, but fold their scores over the kept slots only (an evicted
    token is never scored again). The steady decode step is then
    RotatingKVCache's (two slice updates, MLX's SDPA over the whole buffer;
    scores folded a queue at a time) instead of a victim write and a score fold
    every token, for ``evict_batch / 2`` fewer scored heavy hitters on
    average (docs/RESULTS.md). 1 (the default) is per-step H2O. At most
    ``heavy_budget`` minus the pinned positions.
    """

    max_size: int
    sink_size: int = 4
    heavy_budget: Optional[int] = None
    recent_budget: Optional[int] = None
    score: str = "accumulated"
    ema_alpha: float = 0.95
    pinned: Tuple[Tuple[int, int], ...] = field(default_factory=tuple)
    step: int = 256
    prefill_window: int = 32
    prefill_pool: int = 21
    prefill_compact: str = "preview"
    evict_batch: int = 1

    def __post_init__(self):
        check_int("max_size", self.max_size, 1)
        check_int("sink_size", self.sink_size, 0)
        heavy, recent = _split(
            self.max_size, self.sink_size, self.heavy_budget, self.recent_budget
        )
        object.__setattr__(self, "heavy_budget", heavy)
        object.__setattr__(self, "recent_budget", recent)
        _check_choice("score", self.score, SCORE_MODES)
        _check_alpha(self.ema_alpha)
        object.__setattr__(self, "pinned", _check_pinned(self.pinned, heavy))
        check_int("step", self.step, 1)
        check_int("prefill_window", self.prefill_window, 0)
        check_int("prefill_pool", self.prefill_pool, 0)
        _check_choice("prefill_compact", self.prefill_compact, PREFILL_COMPACT)
        check_int("evict_batch", self.evict_batch, 1)
        room = heavy - self.pinned_count
        if self.evict_batch > max(room, 1):
            raise ValueError(
                f"evict_batch={self.evict_batch} exceeds the {room} heavy-hitter slots "
                "that are not pinned: use an evict_batch <= heavy_budget - pinned"
            )

    @property
    def pinned_count(self) -> int:
        return sum(end - start for start, end in self.pinned)


def is_int(value) -> bool:
    """A Python int that is not a bool (``True`` is an int subclass)."""
    return isinstance(value, int) and not isinstance(value, bool)


def check_int(name: str, value, lowest: Optional[int] = None) -> int:
    """``value`` if it is an int (not a bool) >= ``lowest``: else TypeError /
    ValueError naming ``name``."""
    if not is_int(value):
        raise TypeError(
            f"{name} must be an int, got {value!r} ({type(value).__name__})"
        )
    if lowest is not None and value < lowest:
        raise ValueError(
            f"{name} must be >= {lowest}, got {value}: use {name} >= {lowest}"
        )
    return value


def check_window_size(window_size: Optional[int]) -> Optional[int]:
    """``window_size`` of a cache: None (full attention) or an int >= 1."""
    if window_size is None:
        return None
    return check_int("window_size", window_size, 1)


def _check_choice(name, value, choices):
    if not isinstance(value, str):
        raise TypeError(
            f"{name} must be a str, one of {choices}; "
            f"got {value!r} ({type(value).__name__})"
        )
    if value not in choices:
        what = "a score mode" if name == "score" else "a compaction point"
        raise ValueError(f"{name}={value!r} is not {what}; use one of {choices}")


def _check_alpha(alpha):
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise TypeError(
            "ema_alpha must be a float in (0, 1), "
            f"got {alpha!r} ({type(alpha).__name__})"
        )
    if not 0.0 < alpha < 1.0:  # NaN fails too
        raise ValueError(
            f"ema_alpha must be in (0, 1), got {alpha}: e.g. ema_alpha=0.95"
        )


def _split(max_size, sink, heavy, recent):
    """(heavy, recent) with ``sink + heavy + recent == max_size``; unset budgets
    are derived (both unset: recent gets half of the rest, at least 1)."""
    for name, v in (("heavy_budget", heavy), ("recent_budget", recent)):
        if v is not None:
            check_int(name, v, 0)
    if sink >= max_size:
        raise ValueError(
            f"sink_size={sink} leaves no room in max_size={max_size}: "
            "use a sink_size smaller than max_size"
        )
    rest = max_size - sink
    if heavy is not None and recent is not None and sink + heavy + recent != max_size:
        raise ValueError(
            f"sink_size + heavy_budget + recent_budget = {sink} + {heavy} + {recent}"
            f" must equal max_size={max_size}: leave one budget unset to derive it"
        )
    if recent is not None and recent < 1:
        raise ValueError(
            f"recent_budget must be >= 1, got {recent}: the newest token must stay "
            "in the cache; leave it unset to derive it"
        )
    if recent is not None and recent > rest:
        raise ValueError(
            f"recent_budget={recent} exceeds max_size - sink_size = {rest}: use "
            f"recent_budget <= {rest}, or leave it unset"
        )
    if heavy is not None and heavy >= rest:
        raise ValueError(
            "recent_budget must be >= 1 (the newest token must stay in the cache), "
            f"but heavy_budget={heavy} leaves max_size - sink_size - heavy_budget = "
            f"{rest - heavy}: use heavy_budget <= {rest - 1}, or leave it unset"
        )
    if recent is None:
        recent = rest - heavy if heavy is not None else max(rest // 2, 1)
    return rest - recent, recent


def _check_pinned(pinned, heavy):
    if not isinstance(pinned, (tuple, list)):
        raise TypeError(
            "pinned must be a tuple of (start, end) int pairs, got "
            f"{pinned!r} ({type(pinned).__name__}): e.g. pinned=((0, 8),) or ()"
        )
    ranges = []
    for r in pinned:
        if not isinstance(r, (tuple, list)) or len(r) != 2 or not all(map(is_int, r)):
            raise TypeError(
                f"pinned must be a tuple of (start, end) int pairs; {r!r} in "
                f"pinned={pinned!r} is not one (one range: pinned=((start, end),))"
            )
        if r[0] >= r[1]:
            raise ValueError(
                f"pinned range {r!r} must be (start, end) with start < end: "
                "write it as (first position, last position + 1)"
            )
        if r[0] < 0:
            raise ValueError(
                f"pinned range {r!r} starts before position 0: start it at >= 0"
            )
        ranges.append((r[0], r[1]))
    ranges.sort()
    for (_, e0), (s1, _) in zip(ranges, ranges[1:]):
        if s1 < e0:
            raise ValueError(
                f"pinned ranges overlap: {ranges}; merge them into one range"
            )
    count = sum(e - s for s, e in ranges)
    if count > heavy:
        raise ValueError(
            f"pinned ranges {list(ranges)} hold {count} positions, which exceed "
            f"heavy_budget={heavy}: pinned tokens use heavy-hitter slots; "
            "raise heavy_budget"
        )
    return tuple(ranges)


def with_max_size(config: H2OConfig, max_size: int) -> H2OConfig:
    """``config`` at another ``max_size``: same sink, heavy and recent scaled by
    the same factor (heavy rounded to nearest, recent gets the rest, >= 1)."""
    check_int("max_size", max_size, 1)
    sink = config.sink_size
    if max_size < sink + 2:
        raise ValueError(
            f"max_size={max_size} is below sink_size + 2 = {sink + 2}: a layer needs "
            "its sinks plus at least one heavy and one recent slot"
        )
    rest, old = max_size - sink, config.max_size - sink
    heavy = min(int(config.heavy_budget * rest / old + 0.5), rest - 1)
    # A smaller layer evicts fewer at once: never more than its free heavy slots.
    batch = max(1, min(config.evict_batch, heavy - config.pinned_count))
    return replace(
        config,
        max_size=max_size,
        heavy_budget=heavy,
        recent_budget=rest - heavy,
        evict_batch=batch,
    )


def config_to_dict(config: H2OConfig) -> Dict[str, Any]:
    d = asdict(config)
    d["pinned"] = [list(r) for r in config.pinned]
    # Values from before the options existed are left out: meta states (the
    # Swift port reads them) and result keys stay as they were written
    # (config_from_dict reads a missing prefill_compact as "chunk").
    if config.prefill_compact == "chunk":
        del d["prefill_compact"]
    if config.evict_batch == 1:
        del d["evict_batch"]
    return d


def config_from_dict(d: Dict[str, Any]) -> H2OConfig:
    """The config ``config_to_dict`` wrote (JSON lists back to tuples)."""
    if not isinstance(d, dict):
        raise TypeError(
            f"a config must be a dict of H2OConfig fields, got {type(d).__name__}"
        )
    d = dict(d)
    d.setdefault("prefill_compact", "chunk")  # config_to_dict leaves "chunk" out
    pinned = d.get("pinned", ())
    if isinstance(
        pinned, list
    ):  # JSON has no tuples; anything else is checked as given
        d["pinned"] = tuple(tuple(r) if isinstance(r, list) else r for r in pinned)
    return H2OConfig(**d)
