"""Cache statistics: tokens seen, kept and evicted per layer; KV bytes against
what mlx-lm's KVCache would hold for the same tokens."""

from dataclasses import asdict, dataclass
from typing import Any, Dict, List, Optional, Tuple, Union

import mlx.core as mx
from mlx_lm.models.cache import KVCache

Number = Union[int, float]


@dataclass
class CacheStats:
    """One sequence's H2O caches (every row of a batch holds the same counts).

    Tokens count per attention layer: ``tokens_seen`` went through each
    layer's cache, of which it holds ``tokens_kept`` and dropped
    ``tokens_evicted``; each is the mean over the layers (which agree under
    the uniform budget, except where a sliding window holds fewer), so
    ``tokens_seen == tokens_kept + tokens_evicted``. ``layer_*``: per layer.

    Bytes are summed over layers, the sequences of a batch and (under
    ``mlx.launch``) the ranks: ``kv_bytes`` what the caches hold (K/V buffers,
    slot positions and scores); ``kvcache_bytes`` the K/V mlx-lm's ``KVCache``
    holds for exactly the tokens seen (a sliding-window layer's
    ``RotatingKVCache``: at most its window); ``kvcache_allocated_bytes`` what
    it allocates for them (whole steps of ``KVCache.step``, 256 tokens).
    """

    layers: int  # attention layers with an H2O cache
    tokens_seen: Number
    tokens_kept: Number
    tokens_evicted: Number
    kv_bytes: int
    kvcache_bytes: int
    kvcache_allocated_bytes: int
    layer_seen: Tuple[int, ...] = ()
    layer_kept: Tuple[int, ...] = ()
    layer_evicted: Tuple[int, ...] = ()
    layer_budget: Tuple[int, ...] = ()  # each layer's max_size
    ranks: int = 1  # processes whose caches these are (mlx.launch; over_ranks)

    def as_dict(self):
        return asdict(self)

    @property
    def max_kv_size(self) -> Number:
        """The budget: every layer's max_size, or their mean under a layer profile."""
        return _mean(self.layer_budget)

    def usage(self) -> Dict[str, Any]:
        """The JSON of a server response's ``usage["h2o"]`` (its request's cache)."""
        budget = self.layer_budget or (0,)
        return {"layers": self.layers, "tokens_seen": self.tokens_seen,
                "tokens_kept": self.tokens_kept, "tokens_evicted": self.tokens_evicted,
                "max_kv_size": self.max_kv_size,
                "layer_max_size": [min(budget), max(budget)], "kv_bytes": self.kv_bytes,
                "kvcache_bytes": self.kvcache_bytes,
                "kvcache_allocated_bytes": self.kvcache_allocated_bytes}

    def summary(self) -> str:
        """One line: tokens a layer, then KV bytes against mlx-lm's KVCache."""
        ranks = f", KV bytes of {self.ranks} ranks" if self.ranks > 1 else ""
        lo, hi = min(self.layer_kept, default=0), max(self.layer_kept, default=0)
        spread = f" ({lo}..{hi} by layer)" if lo != hi else ""
        b_lo, b_hi = min(self.layer_budget, default=0), max(self.layer_budget, default=0)
        budget = f"{b_lo}" if b_lo == b_hi else f"{b_lo}..{b_hi}, mean {self.max_kv_size}"
        head = (f"H2O cache (tokens a layer, mean over {self.layers} layers{ranks}): "
                f"seen {self.tokens_seen} = kept {self.tokens_kept}{spread} + evicted "
                f"{self.tokens_evicted}; budget {budget} a layer")
        return f"{head} | {self.memory()}"

    def memory(self) -> str:
        """The KV bytes held next to mlx-lm's KVCache's for the same tokens."""
        if not self.kvcache_bytes:  # no token yet, or a cache whose K/V is not known
            return f"KV {_size(self.kv_bytes)}"
        theirs = (f"mlx-lm's KVCache: {_size(self.kvcache_bytes)} for the "
                  f"{self.tokens_seen} tokens ({_size(self.kvcache_allocated_bytes)} "
                  f"allocated in {KVCache.step}-token steps)")
        if not any(self.layer_evicted):
            return f"KV {_size(self.kv_bytes)}, nothing evicted; {theirs}"
        ratio = self.kvcache_bytes / max(self.kv_bytes, 1)
        size = f"{ratio:.2f}x less" if ratio >= 1 else f"{1 / ratio:.2f}x more"
        return f"KV {_size(self.kv_bytes)} ({size}); {theirs}"


def _size(n: int) -> str:
    return f"{n / 2**20:.2f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


def _mean(values) -> Number:
    """The mean of ints: an int when exact, else rounded to 2 decimals."""
    total, n = sum(values), max(len(values), 1)
    return total // n if total % n == 0 else round(total / n, 2)


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


def _from_layers(seen, kept, evicted, budget, **rest) -> CacheStats:
    return CacheStats(layers=len(seen), tokens_seen=_mean(seen), tokens_kept=_mean(kept),
                      tokens_evicted=_mean(evicted), layer_seen=tuple(seen),
                      layer_kept=tuple(kept), layer_evicted=tuple(evicted),
                      layer_budget=tuple(budget), **rest)


def _local_stats(cache: List[Any]) -> CacheStats:
    # A hybrid layer's CacheList holds its H2O cache next to SSM state.
    layers = [m for c in cache for m in getattr(c, "caches", (c,))]
    h2o = [c for c in layers if hasattr(c, "h2o_attention")]
    if not h2o:
        raise ValueError("the prompt cache holds no H2O cache")
    token_bytes = [_token_bytes(c) for c in h2o]
    held = [c.offset if c.window_size is None else min(c.offset, c.window_size) for c in h2o]
    slots = [kvcache_slots(c.offset, c.window_size) for c in h2o]
    return _from_layers(
        [c.offset for c in h2o], [c.size() for c in h2o], [c.evicted for c in h2o],
        [c.max_size for c in h2o], kv_bytes=sum(c.nbytes for c in h2o),
        kvcache_bytes=sum(n * b for n, b in zip(held, token_bytes)),
        kvcache_allocated_bytes=sum(n * b for n, b in zip(slots, token_bytes)))


_COUNTERS = ("layer_seen", "layer_kept", "layer_evicted", "layer_budget")
_BYTES = ("kv_bytes", "kvcache_bytes", "kvcache_allocated_bytes")


def over_ranks(local: CacheStats, group: mx.distributed.Group,
               split: str = "heads") -> CacheStats:
    """Every rank's ``local`` stats as one (a collective: every rank calls it).

    ``split="heads"`` (tensor parallel: each rank holds whole KV heads of every
    layer): the bytes are summed over ranks; tokens seen / kept / evicted
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
    head = [getattr(local, name) for name in _BYTES] + [local.layers]
    total = _all_sum(head + counters, group)
    width = len(_BYTES)
    if total[width] != n * local.layers or total[width + 1:] != [n * v for v in counters]:
        raise RuntimeError(
            "the ranks' H2O caches disagree on layers or tokens seen / kept / evicted "
            "per KV head; under tensor parallelism every rank holds every layer and "
            "sees the same tokens (are the ranks running the same model and prompt?)")
    return CacheStats(**{**local.as_dict(), **dict(zip(_BYTES, total)), "ranks": n})


def _joined_over_layers(local: CacheStats, group, n: int) -> CacheStats:
    rank, width = group.rank(), len(_COUNTERS)
    sizes = _all_sum([local.layers if r == rank else 0 for r in range(n)], group)
    offset = sum(sizes[r] for r in range(rank + 1, n))  # the ranks after hold earlier layers
    table = [0] * (sum(sizes) * width)
    for j in range(local.layers):
        for k, name in enumerate(_COUNTERS):
            table[(offset + j) * width + k] = getattr(local, name)[j]
    # Each rank's own entries (the rest zero) sum to every rank's in one call.
    total = _all_sum([getattr(local, name) for name in _BYTES] + table, group)
    head = len(_BYTES)
    columns = (total[head + k :: width] for k in range(width))
    return _from_layers(*columns, **dict(zip(_BYTES, total)), ranks=n)
