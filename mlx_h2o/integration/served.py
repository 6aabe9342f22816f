"""What a hardened server serves and what one request may ask of it.

``ServerLimits`` holds the limits of `mlx-h2o serve`'s limit flags;
``ServedModel`` the facts about the model fixed at start that requests are
checked against (its names, vocabulary, whether it reads images).
"""

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import FrozenSet, Optional

DEFAULT_MODEL_KEY = "default_model"  # mlx_lm.server's name for the model given at start


@dataclass(frozen=True)
class ServerLimits:
    """Limits on one request; each field is the flag of the same name."""

    max_body_bytes: int = 1 << 20
    max_prompt_tokens: int = 32768
    max_tokens_limit: int = 8192
    header_timeout: float = 10.0
    body_timeout: float = 30.0
    allow_remote_images: bool = False

    def __post_init__(self):
        for name in ("max_body_bytes", "max_prompt_tokens", "max_tokens_limit"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        for name in ("header_timeout", "body_timeout"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise ValueError(f"{name} must be a number of seconds > 0, got {value!r}")

    @property
    def max_sequence(self) -> int:
        """The most tokens one request may see: its prompt and its answer."""
        return self.max_prompt_tokens + self.max_tokens_limit


@dataclass(frozen=True)
class ServedModel:
    """The model fixed at start, as requests may name it.

    ``name``: the id clients see (``/v1/models``, responses); ``aliases``:
    every ``model`` value a request may give for it; ``draft``: the draft model
    as given at start (None: none); ``vocab_size``: token ids below it exist
    (for ``logit_bias`` and ``top_k``); ``vision``: the model reads images."""

    name: str
    vocab_size: int
    aliases: FrozenSet[str] = frozenset()
    draft: Optional[str] = None
    vision: bool = False
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self):
        if not self.name or self.vocab_size < 1:
            raise ValueError("a served model needs a name and a vocabulary")
        object.__setattr__(self, "aliases",
                           frozenset(self.aliases) | {self.name, DEFAULT_MODEL_KEY})

    @classmethod
    def from_provider(cls, provider, given: str, draft: Optional[str] = None):
        """The model ``provider`` (an ``mlx_lm.server.ModelProvider``) has loaded;
        ``given``: ``--model`` as the user typed it. A local folder is shown by
        its name only, so clients learn nothing of the file system."""
        name = Path(given).name if Path(given).expanduser().is_dir() else given
        tokenizer = provider.tokenizer
        # The first encode settles the tokenizer's truncation and padding state,
        # so the handler threads' later calls only read it.
        tokenizer.encode("warm up")
        size = min(len(tokenizer), _logits_size(provider.model) or len(tokenizer))
        return cls(name=name, vocab_size=size, aliases=frozenset({given}), draft=draft,
                   vision=provider.processor is not None)


def _logits_size(model) -> Optional[int]:
    """The model's output width, where its config says it."""
    args = getattr(model, "args", None)
    size = getattr(args, "vocab_size", None)
    if size is None:
        text = getattr(args, "text_config", None)
        size = text.get("vocab_size") if isinstance(text, dict) else getattr(
            text, "vocab_size", None)
    return size if isinstance(size, int) and size > 0 else None
