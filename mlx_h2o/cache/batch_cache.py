"""BatchH2OKVCache: H2O eviction under mlx-lm's batched generation.

mlx-lm's ``BatchGenerator`` (``batch_generate``, ``mlx_lm.server``) merges the
caches of single sequences into one batch cache, pads prompts, lets rows join
(``extend``) and leave (``filter``) while others decode, and takes a finished
row's cache back out (``extract``) for its prompt cache. This is that batch
contract (``BatchKVCache``'s) for H2O caches: each row, and each KV head of
it, keeps what an ``H2OKVCache`` fed that row alone keeps (the same policy
functions, the same decisions, at the row's own offset).

Rows share one slot axis; a slot that holds no token of its row (padding,
an evicted token, room another row needed) has position ``policy.EMPTY``:
masked, never scored, kept or counted. Outside a prefill chunk the slots
never exceed ``max_size`` (a chunk that overflows is attended in full, then
compacted, as H2OKVCache does).

Speed paths (docs/DESIGN.md): a prompt chunk whose rows are scored by their
last ``prefill_window`` queries is attended by MLX's fused SDPA, and only
those queries' logits are computed; a decode step writes each row's token
metadata, attends, folds and picks each row's next slot in the fused GPU
kernels, or in one compiled call of MLX ops (``decode/rows.py``).
"""

import json
from typing import List, NamedTuple, Optional, Tuple

import mlx.core as mx
import numpy as np

from .. import policy
from ..config import H2OConfig, check_window_size, config_from_dict, config_to_dict
from ..kernels import attention_with_column_sums, scaled_dot_product_attention_with_scores
from ..scores import score_mode
from . import batch_slots as bs
from .batch_rows import BatchRows
from .decode.rows import RowsDecode, RowsStep
from .h2o import H2OKVCache


class _Call(NamedTuple):
    """What an update tells the attention call that follows it."""

    qpos: Optional[mx.array]  # (B, L) query positions, EMPTY for padding; None: decode
    select: mx.array  # (B, L) queries each row folds; (B, W) of ``columns`` if given
    pooled: Optional[mx.array] = None  # (B,) rows whose scores are pooled (policy.chunk_fold)
    compact: Tuple[int, ...] = ()  # rows to compact to max_size after the fold
    # (B,) rows scored by expected attention, (B, W) their window's queries
    expected: Optional[Tuple[mx.array, mx.array]] = None
    columns: Optional[mx.array] = None  # (B, W) the only queries a chunk scores
    step: Optional[RowsDecode] = None  # a decode step's (decode/rows.py)


class BatchH2OKVCache(BatchRows):
    """A batch of H2O caches (mlx-lm's batch cache contract).

    ``offset`` (B,) int32 is each row's RoPE position of its next token
    (negative while left padding is pending). Per row, ``seen`` tokens were
    fed, ``kept`` are held (``evicted = seen - kept``). Build one with
    ``merge`` (from ``H2OKVCache``s) or ``BatchH2OKVCache(config, B)``.
    """

    def __init__(self, config: H2OConfig, batch_size: int = 0,
                 window_size: Optional[int] = None, left_padding=None):
        if not isinstance(config, H2OConfig):
            raise TypeError(f"config must be an H2OConfig, got {type(config).__name__}")
        if config.evict_batch != 1:
            raise ValueError(
                f"evict_batch={config.evict_batch}: the batched H2O cache evicts every "
                "step; use evict_batch=1")
        self.config = config
        self.window_size = check_window_size(window_size)
        self.model_name = ""
        self.keys = self.values = self.positions = self.score = self.count = None
        self._n = 0  # slots in use (shared by the rows)
        self._call = None
        self._target = None  # (B, Hk, 1) slot of each row's next decode token
        self._keys_scored_by = None  # the score mode _keys_scored was decided for
        self._step = None  # the decode step (RowsStep) of this config and window
        self.token_bytes = 0
        self._set_rows([0] * batch_size, [0] * batch_size,
                       list(left_padding or [0] * batch_size), None)

    @property
    def max_size(self) -> int:
        return self.config.max_size

    # --- mlx-lm cache contract -------------------------------------------------
    def update_and_fetch(self, keys: mx.array, values: mx.array):
        if self._call is not None:
            raise RuntimeError(
                "BatchH2OKVCache.update_and_fetch was called again before the attention "
                "of the previous call: wrap the forward pass in `with mlx_h2o.patch():`")
        B, _, L, _ = keys.shape
        if B != len(self.seen):
            raise ValueError(f"keys hold {B} rows but the batch cache has {len(self.seen)}")
        self.token_bytes = (keys.nbytes + values.nbytes) // L
        spans = self._take_spans(L)
        if L == 1:
            self._decode(keys, values, spans)
        else:
            self._chunk(keys, values, spans)
        self._sync_offset()
        n = self._n
        if n == self.keys.shape[2]:  # whole buffers: no slice nodes
            return self.keys, self.values
        return self.keys[..., :n, :], self.values[..., :n, :]

    def h2o_attention(self, queries, keys, values, *, scale, mask=None, sinks=None):
        """Attention over the rows' held slots (masks from positions), its
        scores folded row by row, then the compaction of overflowing rows."""
        call, self._call = self._call, None
        if call is None:
            raise RuntimeError("h2o_attention without a preceding update_and_fetch")
        if call.step is not None:
            return self._attend_decode(queries, keys, values, scale, mask, sinks, call.step)
        n, Hk = self._n, keys.shape[1]
        # Until a row evicts, every KV head holds the same positions: one
        # (B, 1, L, N) mask serves all of them, as BatchKVCache's does.
        heads = 1 if self.seen == self.kept else Hk
        own = policy.position_mask(self.positions[:, :heads, :n], call.qpos,
                                   self.window_size)
        mask = policy.combine_masks(own, mask)
        windowed = (call.columns is not None and sinks is None
                    and mask.shape[1] in (1, Hk))
        out, step, seen = self._scored_attention(call, queries, keys, values, scale, mask,
                                                 sinks, windowed)
        self._fold(call, queries, keys, scale, mask, sinks, step, seen)
        self._pack()
        if not windowed:
            # A chunk's logits are large: finish this layer before the next.
            mx.eval(out, self.positions, self.score, self.count)
            return out
        # The next layer waits for this one's slots: left to the end of the
        # forward pass, every layer's chunk K/V and mask would be alive at once
        # (a prefill peak above BatchKVCache's).
        return mx.depends(out, list(self._arrays()))

    def _scored_attention(self, call, queries, keys, values, scale, mask, sinks, windowed):
        """(out, step, seen): the chunk's attention and ``policy.call_columns``
        of the queries each row folds, per cache KV head."""
        mode, heads = self.config.score, self.positions.shape[1]
        if windowed:  # MLX's SDPA attends; only the window's queries are scored
            out = bs.fused_attention(queries, keys, values, scale, mask)
            _, logits, lse = scaled_dot_product_attention_with_scores(
                bs.take_queries(queries, call.columns), keys, values, scale=scale,
                mask=bs.take_mask_rows(mask, call.columns))
            return (out, *bs.selected_columns(mode, logits, lse, call.select, heads))
        select = self._full_select(call)
        if score_mode(mode).magnitude == "abs_logit":
            out, logits, lse = scaled_dot_product_attention_with_scores(
                queries, keys, values, scale=scale, mask=mask, sinks=sinks)
            return (out, *bs.selected_columns(mode, logits, lse, select, heads))
        # Probabilities summed by a GEMM: no (L, N) logits left to fold.
        out, step, seen = attention_with_column_sums(
            queries, keys, values, scale=scale, mask=mask, sinks=sinks, weights=select)
        return (out, *policy.cache_head_columns(step, seen, heads))

    def _fold(self, call, queries, keys, scale, mask, sinks, step, seen):
        n = self._n
        expected = None
        if call.expected is not None:
            rows, window = call.expected
            expected = (rows, *bs.expected_logits(queries, keys, scale, mask, sinks, window))
        score, count = bs.fold_rows(self.config, *self._meta()[1:], step, seen,
                                    self.positions[..., :n], call.pooled, expected)
        self.score[..., :n] = score
        self.count[..., :n] = count
        self._compact(list(call.compact))

    def _full_select(self, call):
        """(B, L) the queries each row folds, when every query was scored."""
        if call.columns is None:
            return call.select
        full = mx.zeros(call.qpos.shape, mx.bool_)
        return mx.put_along_axis(full, call.columns, call.select, axis=1)

    def _attend_decode(self, queries, keys, values, scale, mask, sinks, step):
        """One token per row: the fused kernels on a GPU, else the compiled
        ops step (decode/rows.py)."""
        run = self._step
        if run is None or (run.config, run.window_size) != (self.config, self.window_size):
            run = self._step = RowsStep(self.config, self.window_size)
        out, *meta, nxt = run(self, queries, keys, values, scale, mask, sinks, step)
        self.positions, self.score, self.count = meta
        self._target = nxt
        # Evaluated with the output: left lazy, each step's graph would hold
        # the last one's buffers.
        return mx.depends(out, [*meta, nxt])

    def make_mask(self, N: int, return_array: bool = False, window_size=None, **kwargs):
        # Masks come from slot positions in h2o_attention (padding included).
        return None if N == 1 else "causal"

    def size(self) -> int:
        return self._n

    def empty(self) -> bool:
        return self.keys is None

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self._arrays() if a is not None)

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        """Forget the ``n`` newest tokens of every row, as H2OKVCache.trim does
        for one sequence (exact: ``offset`` drops by n, each row keeps its best
        held tokens below it). ``n`` is capped at the fewest tokens a row has."""
        n = max(0, min(int(n), min(self.seen, default=0)))
        if n == 0 or self.keys is None:
            return 0
        self._trim_rows(n)
        self._sync_offset()
        return n

    # --- state -------------------------------------------------------------------
    @property
    def state(self):
        if self.keys is None:
            return []
        n = self._n
        return tuple(a[:, :, :n] for a in self._arrays())

    @state.setter
    def state(self, v):
        self._call = None
        if not v:
            self._set_arrays((None,) * 5)
            self._n = 0
            return
        self._set_arrays(tuple(mx.array(a) for a in v))
        self._n = self.keys.shape[2]

    @property
    def meta_state(self):
        rows = {"seen": self.seen, "kept": self.kept, "left": self.left,
                "valid": self.valid}
        window = "" if self.window_size is None else str(self.window_size)
        return (json.dumps(config_to_dict(self.config)), window, self.model_name,
                json.dumps(rows))

    @meta_state.setter
    def meta_state(self, v):
        config, window, self.model_name, rows = v
        self.config = config_from_dict(json.loads(config))
        self.window_size = int(window) if window else None
        r = json.loads(rows)
        self._set_rows(r["seen"], r["kept"], r["left"], r["valid"])

    @classmethod
    def from_state(cls, state, meta_state) -> "BatchH2OKVCache":
        obj = cls(config_from_dict(json.loads(meta_state[0])))
        obj.meta_state = meta_state
        obj.state = state
        return obj

    # --- updates -----------------------------------------------------------------
    def _decode(self, keys, values, spans):
        """One token per row: into the row's victim when it is full, else into
        an empty slot (more slots only when a row with a token has none)."""
        cfg, has = self.config, [c == 1 for _, c in spans]
        # A prompt left whole (prefill_compact="prompt") is compacted first.
        whole = [b for b, h in enumerate(has) if h and self.kept[b] > cfg.max_size]
        if whole:
            self._compact(whole)
            self._pack()
        if self.keys is None:
            self._reserve(1, keys, values)
        self._n = self.keys.shape[2]  # decode reads whole buffers (EMPTY slots masked)
        full = [h and k >= cfg.max_size for h, k in zip(has, self.kept)]
        if any(h and not f and k >= self._n for h, f, k in zip(has, full, self.kept)):
            self._reserve(self._n + 1, keys, values)
            self._n = self.keys.shape[2]
        target = self._target if self._target is not None else self._targets(full)
        self._put(target, keys, values, has)
        self.kept = [k + (h and not f) for k, h, f in zip(self.kept, has, full)]
        self.seen = [s + h for s, h in zip(self.seen, has)]
        step = RowsDecode(target, self._written_score(keys), tuple(self.seen), tuple(has),
                          tuple(k >= cfg.max_size for k in self.kept))
        self._call = _Call(None, None, step=step)

    def _written_score(self, keys):
        """policy.written_score of a decode token's keys (0.0 but for key-norm)."""
        if self.config.score != self._keys_scored_by:
            self._keys_scored_by = self.config.score
            self._keys_scored = score_mode(self.config.score).from_keys
        return policy.written_score(self.config.score, keys) if self._keys_scored else 0.0

    def _targets(self, full: List[bool]) -> mx.array:
        """(B, Hk, 1) where each row's decode token goes: its victim, ranked
        for one more token, where ``full``, else its lowest empty slot."""
        pos = self.positions[..., : self._n]
        pri = policy.slot_priority(self.config, *self._meta(), self._seen_rows(1),
                                   self.window_size)
        victim = policy.select_victim(pri, pos)
        rows = mx.array(full)[:, None]
        return mx.where(rows, victim, policy.first_empty(pos)).astype(mx.int32)[..., None]

    def _chunk(self, keys, values, spans):
        """L > 1 tokens: appended as new slots (padding at position EMPTY). A
        row with one token of its own takes H2OKVCache's decode path (its
        victim goes first); one whose chunk overflows is scored by its last
        ``prefill_window`` queries and compacted after the attention."""
        cfg, L = self.config, keys.shape[2]
        ones = [b for b, (_, c) in enumerate(spans) if c == 1]
        self._compact([b for b in ones if self.kept[b] > cfg.max_size])
        self._evict_one([b for b in ones if self.kept[b] >= cfg.max_size])
        qpos = np.full((len(spans), L), policy.EMPTY, np.int32)
        for b, (start, c) in enumerate(spans):
            qpos[b, start : start + c] = np.arange(self.seen[b], self.seen[b] + c)
        self._append(keys, values, mx.array(qpos))
        self.kept = [k + c for k, (_, c) in zip(self.kept, spans)]
        self.seen = [s + c for s, (_, c) in zip(self.seen, spans)]
        plans = [policy.chunk_fold(cfg, c, k - c, self.window_size)
                 for (_, c), k in zip(spans, self.kept)]
        if any(p.replace for p in plans):  # a later chunk on a full row: its window decides
            rows = mx.array([p.replace for p in plans])[:, None, None]
            self.score = mx.where(rows, 0.0, self.score)
            self.count = mx.where(rows, 0.0, self.count)
        select, columns = bs.selection(cfg.prefill_window, spans, [p.over for p in plans], L)
        pooled = [p.pool > 0 for p in plans]
        self._call = _Call(mx.array(qpos), select, mx.array(pooled) if any(pooled) else None,
                           tuple(b for b, p in enumerate(plans) if p.compact),
                           bs.expected_rows(cfg, spans, plans), columns)

    # --- merging single caches --------------------------------------------------------
    @classmethod
    def merge(cls, caches) -> "BatchH2OKVCache":
        """One batch from single-sequence H2OKVCaches of one layer (mlx-lm
        calls ``caches[0].merge(caches)``): each row holds its cache's slots,
        scores and offset; rows with fewer slots get empty ones."""
        first = caches[0]
        for c in caches:
            if type(c) is not H2OKVCache:
                raise ValueError(
                    f"{type(c).__name__} cannot join a batch: batched generation "
                    "(mlx-lm's BatchGenerator, `mlx-h2o serve`) takes dense H2OKVCache "
                    "caches only")
            if (c.config, c.window_size) != (first.config, first.window_size):
                raise ValueError("caches of one layer with different budgets or windows "
                                 f"cannot form a batch: {c.config} vs {first.config}")
        batch = cls(first.config, len(caches), first.window_size)
        batch.model_name = first.model_name
        states = [c.state for c in caches]  # reading the state folds queued scores
        sizes = [c.size() for c in caches]
        if max(sizes, default=0):
            batch.state = bs.stacked(states, sizes)
        batch._set_rows([c.offset for c in caches], sizes, [0] * len(caches), None)
        batch.token_bytes = max(c.token_bytes for c in caches) * len(caches)
        return batch

    def extract(self, idx: int) -> H2OKVCache:
        """Row ``idx`` as a single-sequence H2OKVCache (its held tokens in
        position order, their scores): what the row alone would hold."""
        k, seen = self.kept[idx], self.seen[idx]
        template = H2OKVCache(self.config, self.window_size)
        template.model_name = self.model_name
        template.offset, template.evicted = seen, seen - k
        if self.keys is None or k == 0:
            return template
        row = self._row(idx)
        state = bs.take(row, bs.packed_order(row[2], k))
        return H2OKVCache.from_state(state, template.meta_state)


# mlx-lm merges through the single caches' class: ``caches[0].merge(caches)``.
H2OKVCache.batch_class = BatchH2OKVCache
