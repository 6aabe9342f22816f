"""Cache statistics: tokens seen, kept and evicted, KV bytes vs an unbounded cache."""

from dataclasses import asdict, dataclass
from typing import Any, List


@dataclass
class CacheStats:
    layers: int  # H2O layers
    tokens_seen: int
    tokens_kept: int  # slots in use per layer (max over layers)
    tokens_evicted: int  # per layer, sequence and KV head (max over layers)
    kv_bytes: int  # resident: K/V buffers + positions and scores
    unbounded_kv_bytes: int  # what mlx-lm's KVCache would hold for tokens_seen

    def as_dict(self):
        return asdict(self)

    def summary(self) -> str:
        ratio = self.unbounded_kv_bytes / max(self.kv_bytes, 1)
        # Below its budget a cache holds preallocated slots, so it can be larger.
        size = f"{ratio:.2f}x smaller" if ratio >= 1 else f"{1 / ratio:.2f}x larger"
        return (
            f"H2O cache: seen={self.tokens_seen} kept={self.tokens_kept} "
            f"evicted={self.tokens_evicted} | KV {self.kv_bytes / 2**20:.2f} MiB "
            f"vs unbounded {self.unbounded_kv_bytes / 2**20:.2f} MiB "
            f"({size}) over {self.layers} layers"
        )


def cache_stats(cache: List[Any]) -> CacheStats:
    """Aggregate stats over the H2O caches of a prompt cache."""
    h2o = [c for c in cache if hasattr(c, "h2o_attention")]
    if not h2o:
        raise ValueError("the prompt cache holds no H2O cache")
    return CacheStats(
        layers=len(h2o),
        tokens_seen=max(c.offset for c in h2o),
        tokens_kept=max(c.size() for c in h2o),
        tokens_evicted=max(c.evicted for c in h2o),
        kv_bytes=sum(c.nbytes for c in h2o),
        unbounded_kv_bytes=sum(c.offset * c.token_bytes for c in h2o),
    )
