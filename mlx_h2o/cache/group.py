"""StepGroup: several layers' evicting decode steps folded in one launch per token.

A full H2O cache's decode step needs last token's scores folded and a victim
picked before it writes. Per layer that was one custom attention launch per
token: ~13 us of host time against ~1 us for MLX's SDPA, and 28 us of GPU time
against cuDNN's 8 at 256 keys (docs/DESIGN.md). In a group, a member
in the evicting steady state writes its token into the victim slot, attends
with MLX's SDPA and pushes its query here; the last member's push folds every
pushed query and picks every member's next victim at once (kernels.group_fold),
in the same token's graph. The decisions are those of the per-layer step.

Members are GroupedStep decode steps (cache/decode/grouped.py); the group
reads their caches through ``slot_metadata`` / ``set_slot_metadata`` and
hands each its next victim through ``take_victim``. While members take group
steps, their positions / score / count live here, stacked (``_stack``); any
other use of a member's metadata releases the group (folds what is pending,
hands every member its rows back).
"""

import copy
from operator import is_
from typing import List, Optional

import mlx.core as mx
import numpy as np

from ..kernels.group_fold import group_fold_plan, group_fold_supported, layer_params, max_layers
from . import first_use
from .ops_step import evict_step


class StepGroup:
    """Layers whose evicting decode steps fold together (one launch per token).

    ``use_kernel``: None uses the GPU kernel where it runs and the reference
    (the per-layer policy ops on the stacked state) elsewhere; False forces
    the reference (tests); True requires the kernel.
    """

    def __init__(self, use_kernel: Optional[bool] = None):
        self.use_kernel = use_kernel
        self.members: List = []
        self._pending = {}  # id(member) -> (member, query, slot)
        self._stacked: Optional[List] = None  # members whose metadata is stacked here
        self._ids = frozenset()
        self._meta = None  # (positions, score, count): (n * B, Hk, M)
        self._slot = None  # (n * B, Hk, 1[, D]) where each member's last token went
        self._victims = None  # per stacked member: the victim array handed out
        self._lay_i = self._lay_f = None
        self._lay_next = None  # (device lay_i for offsets + 1, those offsets)
        self._plan = None  # ((query shape, dtype), the stacked members' GroupPlan)
        # Members' (queries, keys) signature, the first one seen, whether it can
        # be folded here, whether by the kernel and whether the kernel's first
        # use must still be checked (decided once, not every token).
        self._sig = None

    def __deepcopy__(self, memo):
        """A group of the members' copies (a copied member holds its own
        metadata again; the fold's plan and signature are made anew)."""
        self.release()
        new = StepGroup(self.use_kernel)
        memo[id(self)] = new
        new.members = [copy.deepcopy(m, memo) for m in self.members]
        return new

    def add(self, member) -> None:
        self.members.append(member)

    def remove(self, member) -> None:
        """``member`` leaves (its cache took another decode step): what is
        pending is folded first, and the others' folds no longer wait for it."""
        self.release()
        self.members = [m for m in self.members if m is not member]

    # --- what members call ------------------------------------------------------
    def takes(self, member, queries: mx.array) -> bool:
        """Whether ``member``'s decode query can be folded here: every member's
        queries and keys must have the first member's shapes and dtypes."""
        cache = member.cache
        kind = cache.kv.group_kind
        sig = (queries.shape, queries.dtype, cache.slot_metadata()[0].shape[1], kind,
               mx.default_device())
        known = self._sig
        if known is None:
            kernel = kind is not None and self._kernel_runs(queries, sig[2], kind)
            self._sig = known = (sig, kind is not None and (kernel or self.use_kernel is False),
                                 kernel, kernel and first_use.needs_check(_family(kind)))
        return known[1] and known[0] == sig

    def push(self, member, queries: mx.array, slot: mx.array, out: mx.array) -> mx.array:
        """``member`` wrote its token into ``slot`` and attended (``out``):
        fold later. Returns ``out``, made to depend on the fold when this was the
        last member to push.

        Folding when the last member pushed, in this token's graph: the fold
        reads every member's K buffer, and a victim write can donate that
        buffer only once the fold's launch has finished on the GPU; folding
        at the next token's start made some writes copy the whole buffer and
        changed a token's kernel list (CUDA-graph updates on the host)."""
        self._pending[id(member)] = (member, queries, slot)
        if len(self._pending) == len(self.members):
            self.flush()
            return mx.depends(out, self._meta[0])
        return out

    def holds(self, member) -> bool:
        return id(member) in self._pending or id(member) in self._ids

    def waits_for(self, member) -> bool:
        """Whether ``member``'s last query is not folded yet."""
        return id(member) in self._pending

    def has_pending(self) -> bool:
        return bool(self._pending)

    def release(self) -> None:
        """Fold what is pending and give every member its metadata back."""
        self.flush()
        if self._stacked is not None:
            self._unstack()
        self._sig = None  # members may come back with other shapes (a new batch)

    def flush(self) -> None:
        """Fold every pushed query; each pushing member gets its next victim."""
        pending = self._pending
        if not pending:
            return
        self._pending = {}
        # In members' order. This runs once a token on the host-bound decode
        # path (~50 us of Python on an H200 host, docs/DESIGN.md).
        items = [pending[id(m)] for m in self.members if id(m) in pending]
        members, queries, slots = zip(*items)
        if self._stacked is not None and not self._continues(members, slots):
            self._unstack()
        if self._stacked is None:
            self._stack(list(members), slots)
        caches = [m.cache for m in members]
        offsets = [c.offset for c in caches]
        if self._sig[2]:  # pending queries passed takes(): the signature is set
            res = self._fold_checked(caches, queries, offsets)
        else:
            res = self._fold_reference(caches, queries, offsets)
        *self._meta, self._slot, self._victims = res
        for m, v in zip(members, self._victims):
            m.take_victim(v)

    # --- stacking ---------------------------------------------------------------
    def _continues(self, members, slots) -> bool:
        """The same members as the stacked ones, each having written where told."""
        return (len(members) == len(self._stacked) and all(map(is_, members, self._stacked))
                and all(map(is_, slots, self._victims)))

    def _stack(self, members, slots) -> None:
        caches = [m.cache for m in members]
        metas = [c.slot_metadata() for c in caches]
        M = max(meta[0].shape[2] for meta in metas)

        def pad(a):
            extra = M - a.shape[2]
            return a if extra == 0 else mx.pad(a, [(0, 0), (0, 0), (0, extra)])

        self._meta = [mx.concatenate([pad(meta[i]) for meta in metas], axis=0)
                      for i in range(3)]
        # (n * B, Hk, 1, 1), 4-d as the kernel's victims that follow: a
        # precompiled kernel is one build per input ndim (kernels/cubin.py).
        self._slot = mx.concatenate([(s if s.ndim == 4 else s[..., None])[..., :1]
                                     for s in slots], axis=0)
        self._stacked, self._ids = members, frozenset(id(m) for m in members)
        lay_i = [layer_params(0, c.config.sink_size, c.config.recent_budget, c.size(),
                              c.kv.capacity) for c in caches]
        self._lay_i = np.array(lay_i, dtype=np.int32)
        lay_f = [[m.scale, m.cache.config.ema_alpha, 1.0 - m.cache.config.ema_alpha, 0.0]
                 for m in members]
        self._lay_f = mx.array(lay_f, dtype=mx.float32)
        self._lay_next = self._plan = None

    def _unstack(self) -> None:
        pos, score, count = self._meta
        B = pos.shape[0] // len(self._stacked)
        for i, m in enumerate(self._stacked):
            rows, cap = slice(i * B, (i + 1) * B), m.cache.slot_metadata()[0].shape[2]
            m.cache.set_slot_metadata(
                pos[rows, :, :cap], score[rows, :, :cap], count[rows, :, :cap])
        self._stacked, self._ids, self._meta, self._slot, self._victims = (
            None, frozenset(), None, None, None)

    # --- the fold ---------------------------------------------------------------
    def _kernel_runs(self, queries, n_kv_heads: int, kind) -> bool:
        if self.use_kernel is False:
            return False
        B, Hq, _, D = queries.shape
        ok = (group_fold_supported(queries.dtype, D, Hq, n_kv_heads, *_quant(kind))
              and first_use.passed(_family(kind)))
        if self.use_kernel and not ok:
            raise ValueError("StepGroup(use_kernel=True): the group fold kernel does not "
                             f"run here for {queries.dtype} queries {queries.shape}")
        return ok and len(self.members) <= max_layers()

    def _fold_checked(self, caches, queries, offsets):
        """The kernel's fold; on Metal its first one is checked against the
        reference (cache/first_use.py), which serves from then on if it differed."""
        if not self._sig[3]:
            return self._fold_kernel(caches, queries, offsets)
        family, mode = _family(caches[0].kv.group_kind), caches[0].config.score
        res = first_use.checked(
            family, lambda: self._fold_kernel(caches, queries, offsets),
            lambda: self._fold_reference(caches, queries, offsets),
            lambda got, want: first_use.group_differs(mode, got, want))
        self._sig = (*self._sig[:2], first_use.passed(family), first_use.needs_check(family))
        return res

    def _fold_kernel(self, caches, queries, offsets):
        # Each token's offsets come from the last launch's device copy when they
        # advanced by one (the steady state); a host-written array every token
        # cost the kernel ~150 us of GPU time on the H100 (docs/DESIGN.md).
        nxt = self._lay_next
        if nxt is not None and nxt[1] == offsets:
            lay_i = nxt[0]
        else:
            self._lay_i[:, 0] = offsets
            lay_i = mx.array(self._lay_i)
        keys = [c.kv.group_keys for c in caches]
        # The plan is checked and looked up once per stacking and query shape,
        # not every token (host time, docs/DESIGN.md).
        key = (queries[0].shape, queries[0].dtype)
        if self._plan is None or self._plan[0] != key:
            cfg = caches[0].config
            bits, group_size = _quant(caches[0].kv.group_kind)
            self._plan = (key, group_fold_plan(queries, keys, self._meta[0], mode=cfg.score,
                                               pinned=cfg.pinned, bits=bits,
                                               group_size=group_size))
        res = self._plan[1](queries, keys, lay_i, self._lay_f, *self._meta, self._slot)
        self._lay_next = (res.lay_i, [o + 1 for o in offsets])
        return res.positions, res.score, res.count, res.victim, res.victims

    def _fold_reference(self, caches, queries, offsets):
        """The per-layer policy ops on the stacked state (what the kernel computes)."""
        pos, score, count = self._meta
        B = pos.shape[0] // len(caches)
        outs = []
        for i, (m, offset) in enumerate(zip(self._stacked, offsets)):
            c, rows = m.cache, slice(i * B, (i + 1) * B)
            width = 1 if c.kv.group_kind[0] == "quantized" else None
            outs.append(fold_layer(c.config, queries[i], c.kv.dense_keys(c.size()),
                                   c.size(), m.scale, offset, pos[rows], score[rows],
                                   count[rows], self._slot[rows], width))
        pos, score, count, victim = (mx.concatenate(x, axis=0) for x in zip(*outs))
        return pos, score, count, victim, [o[3] for o in outs]


def fold_layer(config, q, keys, n, scale, offset, pos, score, count, slot, width=None):
    """One layer's fold and next victim, as its per-layer op path does them
    (ops_step.evict_step over the first n slots of ``keys``, dense). Returns
    (positions, score, count, victim (B, Hk, 1, width or D)) with slots >= n
    copied through."""
    kn = keys[..., :n, :]
    _, p, s, k, victim = evict_step(config, scale, q, kn, kn, pos[..., :n], score[..., :n],
                                    count[..., :n], slot, offset)
    victim = mx.broadcast_to(victim, (*victim.shape[:3], width or keys.shape[3]))
    tail = [a[..., n:] for a in (pos, score, count)]
    return (*(mx.concatenate([x, t], axis=2) for x, t in zip((p, s, k), tail)), victim)


def _family(kind) -> str:
    """The group fold's family for the Metal first-use check, by storage kind."""
    return f"group fold {kind[0]}"


def _quant(kind):
    """(bits, group_size) of a storage's group kind; (None, 64) for dense."""
    return (kind[1], kind[2]) if kind[0] == "quantized" else (None, 64)


def link_layers(caches) -> List[StepGroup]:
    """What a model's H2O caches share beside their state, set up as
    ``make_h2o_cache`` does (and ``load_prompt_cache`` again): score folds
    staggered over the layers, and on a GPU step groups (one fold launch a
    token). Both change when work runs, not what it computes."""
    for j, c in enumerate(caches):
        c.set_fold_phase(len(caches) - 1 - j)
    return make_groups(caches)


def make_groups(caches, size: Optional[int] = None, use_kernel=None) -> List[StepGroup]:
    """Group the caches that can take group steps: same score mode and pins
    (the kernel's constants), at most ``size`` a group (default ``max_layers()``:
    Metal binds few buffers per kernel; no groups without a GPU backend)."""
    by_key = {}
    for c in caches:
        if c.groupable():
            key = (c.config.score, c.config.pinned, c.kv.group_kind)
            by_key.setdefault(key, []).append(c)
    groups = []
    for (_, _, kind), same in by_key.items():
        n = max_layers() if size is None else size
        for i in range(0, len(same) if n > 0 else 0, max(n, 1)):
            g = StepGroup(use_kernel)
            for c in same[i:i + n]:
                c.join_group(g)
            groups.append(g)
    return groups
