"""DecodeStep: how a decode token (L == 1) enters an H2O cache and is attended.

``H2OKVCache.update_and_fetch`` hands every decode token to ``update``, and
``h2o_attention`` hands its query to ``attend``. A step owns what it holds
between the two calls or across tokens (a score queue, a kernel plan, a
group's stack); the cache owns the slots (cache/core.py).
"""


class DecodeStep:
    """The interface of the decode steps (cache/decode/)."""

    kind = ""  # the name decode_step() was given ("reference", "compiled", "fused")

    def __init__(self, cache):
        self.cache = cache

    def find(self, cls):
        """The step of class ``cls`` in this chain of wrappers, or None."""
        return self if isinstance(self, cls) else None

    def update(self, keys, values):
        """Write this decode token's K/V into the cache; what attention reads."""
        raise NotImplementedError

    def attend(self, queries, keys, values, scale, mask, sinks):
        """The token's attention output, its scores folded into the slots."""
        raise NotImplementedError

    def sync(self) -> None:
        """Hand back what this step holds of the slot metadata, up to date
        (queued folds folded, a group's stack returned): before a read."""

    def forget(self) -> None:
        """Drop what this step decided for the slots as they were (picked
        plans, queued queries): the slots were replaced or are copied."""

    def stagger(self, phase: int) -> None:
        """Make this layer's periodic work (score queue folds) fall ``phase``
        tokens apart from other layers'."""


class Wrapper(DecodeStep):
    """A step around another one (the score queue, bulk eviction, a group)."""

    def __init__(self, inner: DecodeStep):
        super().__init__(inner.cache)
        self.inner = inner
        self.kind = inner.kind

    def find(self, cls):
        return self if isinstance(self, cls) else self.inner.find(cls)

    def update(self, keys, values):
        return self.inner.update(keys, values)

    def attend(self, queries, keys, values, scale, mask, sinks):
        return self.inner.attend(queries, keys, values, scale, mask, sinks)

    def sync(self) -> None:
        self.inner.sync()

    def forget(self) -> None:
        self.inner.forget()

    def stagger(self, phase: int) -> None:
        self.inner.stagger(phase)
