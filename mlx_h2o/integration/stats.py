"""Cache statistics: tokens seen, kept and evicted per layer; KV bytes vs mlx-lm's KVCache."""

from dataclasses import asdict, dataclass
from typing import Any, List, Optional, Tuple

import mlx.core as mx
from mlx_lm.models.cache import KVCache


@dataclass
class CacheStats:
    """Per H2O layer: ``seen == kept + evicted`` (tokens per sequence and KV head).

    ``unbounded_kv_bytes`` is what mlx-lm's ``KVCache`` would really hold for
    the tokens seen: it preallocates ``KVCache.step`` (256) slots at a time; a
    sliding-window layer's ``RotatingKVCache`` at most its window.
    """

    layers: int  # H2O layers
    tokens_seen: int  # max over layers (every layer sees the same tokens)
    tokens_kept: int  # max over layers
    tokens_evicted: int  # max over layers
    kv_bytes: int  # resident: K/V buffers + positions and scores
    unbounded_kv_bytes: int  # what mlx-lm's KVCache would hold (preallocated)
    layer_seen: Tuple[int, ...] = ()
    layer_kept: Tuple[int, ...] = ()
    layer_evicted: Tuple[int, ...] = ()
    layer_budget: Tuple[int, ...] = ()  # each layer's max_size
    kvcache_slots: int = 0  # slots a layer of mlx-lm's KVCache would hold
    ranks: int = 1  # processes whose caches these are (mlx.launch; over_ranks)

    def as_dict(self):
        return asdict(self)

    def summary(self) -> str:
        seen, kept, evicted = (sum(x) for x in
                               (self.layer_seen, self.layer_kept, self.layer_evicted))
        n = max(self.layers, 1)
        lo, hi = min(self.layer_kept, default=0), max(self.layer_kept, default=0)
        per_layer = f"kept {lo}" if lo == hi else f"kept {lo}..{hi} (mean {kept / n:.1f})"
        ranks = f", KV bytes of {self.ranks} ranks" if self.ranks > 1 else ""
        head = (f"H2O cache (sums over {self.layers} layers{ranks}): seen {seen} = kept "
                f"{kept} + evicted {evicted}; per layer: seen {self.tokens_seen}, {per_layer}")
        mib = self.kv_bytes / 2**20
        if not self.unbounded_kv_bytes:  # no token yet, or a cache whose K/V is not known
            return f"{head} | KV {mib:.2f} MiB"
        # Below its budget a cache holds preallocated slots, so it can be larger.
        ratio = self.unbounded_kv_bytes / max(self.kv_bytes, 1)
        size = f"{ratio:.2f}x smaller" if ratio >= 1 else f"{1 / ratio:.2f}x larger"
        return (f"{head} | KV {mib:.2f} MiB vs {self.unbounded_kv_bytes / 2**20:.2f} MiB "
                f"for mlx-lm's KVCache at {self.kvcache_slots} slots a layer ({size})")


def kvcache_slots(seen: int, window=None) -> int:
    """Slots an mlx-lm ``KVCache`` holds after ``seen`` tokens (``RotatingKVCache``
    for a sliding window): whole steps of ``KVCache.step``."""
    slots = -(-seen // KVCache.step) * KVCache.step
    return slots if window is None else min(slots, window)


def _token_bytes(c) -> int:
    """Dense K+V bytes of one token in ``c`` (all sequences, KV heads); read from
    its state when no token has gone through it yet (a loaded cache)."""
    if c.token_bytes or not c.size():
        return c.token_bytes
    state = c.state
    quant = getattr(c, "quant", None)
    if quant is None:  # dense: keys, values (B, n_kv_heads, n, D)
        return (state[0].nbytes + state[1].nbytes) // state[0].shape[2]
    B, n_kv_heads, _, groups = state[1].shape  # scales of the keys (B, Hk, n, D / group)
    return 2 * B * n_kv_heads * groups * quant.group_size * state[1].dtype.size


def cache_stats(cache: List[Any], group: Optional[mx.distributed.Group] = None,
                split: str = "heads") -> CacheStats:
    """Stats over the H2O caches of a prompt cache; with ``group`` (size > 1:
    under ``mlx.launch``) over every rank's caches (``over_ranks``, a
    collective: every rank calls it)."""
    local = _local_stats(cache)
    if group is None or group.size() == 1:
        return local
    return over_ranks(local, group, split)


def _local_stats(cache: List[Any]) -> CacheStats:
    # A hybrid layer's CacheList holds its H2O cache next to SSM state.
    layers = [m for c in cache for m in getattr(c, "caches", (c,))]
    h2o = [c for c in layers if hasattr(c, "h2o_attention")]
    if not h2o:
        raise ValueError("the prompt cache holds no H2O cache")
    seen = tuple(c.offset for c in h2o)
    slots = [kvcache_slots(c.offset, c.window_size) for c in h2o]
    return CacheStats(
        layers=len(h2o),
        tokens_seen=max(seen),
        tokens_kept=max(c.size() for c in h2o),
        tokens_evicted=max(c.evicted for c in h2o),
        kv_bytes=sum(c.nbytes for c in h2o),
        unbounded_kv_bytes=sum(s * _token_bytes(c) for s, c in zip(slots, h2o)),
        layer_seen=seen,
        layer_kept=tuple(c.size() for c in h2o),
        layer_evicted=tuple(c.evicted for c in h2o),
        layer_budget=tuple(c.max_size for c in h2o),
        kvcache_slots=max(slots),
    )


_COUNTERS = ("layer_seen", "layer_kept", "layer_evicted", "layer_budget")


def over_ranks(local: CacheStats, group: mx.distributed.Group,
               split: str = "heads") -> CacheStats:
    """Every rank's ``local`` stats as one (a collective: every rank calls it).

    ``split="heads"`` (tensor parallel: each rank holds whole KV heads of every
    layer): the KV bytes are summed over ranks; tokens seen / kept / evicted
    count per sequence and KV head, so they are the same on every rank (checked,
    not added up). ``split="layers"`` (pipeline parallel): the
    ranks' layers are joined in layer order (the last rank holds the first).
    """
    if split not in ("heads", "layers"):
        raise ValueError(f"split must be 'heads' or 'layers', got {split!r}")
    from mlx_lm.generate import generation_stream

    # mlx-lm's generate leaves its next token's forward (and its all_sums) running
    # on its own stream; collectives of two streams at once garble each other.
    mx.synchronize(generation_stream)
    n = group.size()
    if split == "heads":
        return _summed_over_heads(local, group, n)
    return _joined_over_layers(local, group, n)


def _all_sum(values, group) -> List[int]:
    # The default stream: mlx-lm's server generates on it (its own collectives
    # are ordered with ours). int64: byte counts pass 2**31.
    return mx.distributed.all_sum(mx.array(values, dtype=mx.int64), group=group).tolist()


def _summed_over_heads(local: CacheStats, group, n: int) -> CacheStats:
    counters = [v for name in _COUNTERS for v in getattr(local, name)]
    head = [local.kv_bytes, local.unbounded_kv_bytes, local.layers]
    total = _all_sum(head + counters, group)
    if total[2] != n * local.layers or total[3:] != [n * v for v in counters]:
        raise RuntimeError(
            "the ranks' H2O caches disagree on layers or tokens seen / kept / evicted "
            "per KV head; under tensor parallelism every rank holds every layer and "
            "sees the same tokens (are the ranks running the same model and prompt?)")
    return CacheStats(**{**local.as_dict(), "kv_bytes": total[0],
                         "unbounded_kv_bytes": total[1], "ranks": n})


def _joined_over_layers(local: CacheStats, group, n: int) -> CacheStats:
    rank, width = group.rank(), len(_COUNTERS)
    sizes = _all_sum([local.layers if r == rank else 0 for r in range(n)], group)
    offset = sum(sizes[r] for r in range(rank + 1, n))  # the ranks after hold earlier layers
    table = [0] * (sum(sizes) * width)
    for j in range(local.layers):
        for k, name in enumerate(_COUNTERS):
            table[(offset + j) * width + k] = getattr(local, name)[j]
    # Each rank's own entries (the rest zero) sum to every rank's in one call.
    slots = [local.kvcache_slots if r == rank else 0 for r in range(n)]
    total = _all_sum([local.kv_bytes, local.unbounded_kv_bytes, *slots, *table], group)
    seen, kept, evicted, budget = (tuple(total[2 + n + k :: width]) for k in range(width))
    return CacheStats(
        layers=len(seen), tokens_seen=max(seen), tokens_kept=max(kept),
        tokens_evicted=max(evicted), kv_bytes=total[0], unbounded_kv_bytes=total[1],
        layer_seen=seen, layer_kept=kept, layer_evicted=evicted, layer_budget=budget,
        kvcache_slots=max(total[2 : 2 + n]), ranks=n)
