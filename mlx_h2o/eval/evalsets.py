"""Named perplexity sets: the tuning set defaults are chosen on, and the
evaluation set they are only ever reported on.

- ``tuning``: Jane Austen's novels (``austen``), seed 0. Every default of
  ``H2OConfig`` and the shipped layer profiles were picked on it.
- ``evaluation``: text of other genres that no default was tuned on:
  technical prose (``python-docs``), dialogue (``sharegpt``), code
  (``python-src``), drama in verse (``shakespeare``) and structured data
  (``iso-codes``, JSON), seed 1. A change of a default is reported here.

Both use the three packaged models (three families: llama, gemma3, qwen2) and
the paper protocol (10 windows of 512 tokens, BOS first where the tokenizer
adds one, 32-token prefill, token-by-token decode, ``max_kv`` 256).
Windows are drawn by ``corpora.sample_token_windows``: documents in a seeded
order, disjoint windows from a random offset through each, chosen at random
among those. Changes against the baseline are paired per window
(``ppl.compare``), ratios of two changes by ``ppl.ratio_vs``.
"""

from dataclasses import dataclass
from typing import Any

MODELS = ("smollm2-135m", "gemma3-270m", "qwen2.5-coder-0.5b")


@dataclass(frozen=True)
class EvalSet:
    """Corpora x models x seeds of one named perplexity set."""

    name: str
    corpora: tuple
    models: tuple = MODELS
    seeds: tuple = (0,)
    num_samples: int = 10
    seq_len: int = 512
    prefill: int = 32
    max_kv: int = 256

    def __post_init__(self):
        if not self.corpora or not self.models or not self.seeds:
            raise ValueError(f"eval set {self.name!r}: corpora, models and seeds must be "
                             "non-empty")
        if self.num_samples < 2:
            raise ValueError(f"eval set {self.name!r}: num_samples must be >= 2 "
                             "(paired standard errors)")

    def ppl_args(self, model: str, corpus: str, seed: int) -> list[str]:
        """The ``mlx-h2o ppl`` flags of one (model, corpus, seed): its results
        folder is the one that command uses, so finished units are shared."""
        return ["--model", model, "--corpus", corpus, "-n", str(self.num_samples),
                "--sequence-length", str(self.seq_len), "--prefill", str(self.prefill),
                "--max-kv-size", str(self.max_kv), "--seed", str(seed)]


EVAL_SETS: dict[str, EvalSet] = {
    "tuning": EvalSet("tuning", ("austen",), seeds=(0,)),
    "evaluation": EvalSet(
        "evaluation",
        ("python-docs", "sharegpt", "python-src", "shakespeare", "iso-codes"),
        seeds=(1,)),
}


def eval_set(name: str) -> EvalSet:
    """The named set; ValueError listing the names if unknown."""
    try:
        return EVAL_SETS[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown eval set {name!r}; use one of {tuple(EVAL_SETS)}") from None


def pooled(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Rows of one strategy on several corpora as one row: per-window NLLs
    concatenated (windows stay paired with the baseline's, corpus by corpus)."""
    if not rows:
        raise ValueError("nothing to pool")
    per = [x for r in rows for x in r["nll_per_sample"]]
    return {"strategy": rows[0]["strategy"], "nll_per_sample": per,
            "nll": sum(per) / len(per)}
