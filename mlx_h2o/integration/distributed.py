"""H2O under mlx-lm's tensor and pipeline parallelism (``mlx.launch``).

Tensor parallelism (``model.shard(group)``, mlx-lm's ``sharded_load``) gives
every rank whole KV heads with their query heads: each rank's H2O caches see
only its own heads, score them from its own attention and evict rank-locally,
with no communication beyond mlx-lm's own. Pipeline parallelism gives every
rank whole layers. Budgets are per layer, so they are the same on every rank.

  group = world()                              # mx.distributed.init()
  model, tokenizer = load_sharded("path/or/repo", group)
  cache = make_h2o_cache(model, config)        # this rank's heads (or layers)
  with pipeline_stages(): ...                  # decoding, pipeline parallel
"""

import json
import os
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Optional, Tuple

import mlx.core as mx


def world() -> mx.distributed.Group:
    """The group ``mlx.launch`` started (size 1 in a plain process)."""
    return mx.distributed.init()


def attention_heads(config: dict) -> Tuple[int, int]:
    """(query heads, KV heads) of an mlx-lm / Hugging Face ``config.json``
    (a multimodal model's ``text_config`` when it has one)."""
    text = config.get("text_config") or config
    heads = text.get("num_attention_heads", text.get("n_heads"))
    kv = text.get("num_key_value_heads", text.get("n_kv_heads", heads))
    if not isinstance(heads, int) or not isinstance(kv, int):
        raise ValueError("config.json names no num_attention_heads / num_key_value_heads")
    return heads, kv


class HeadsDoNotDivide(ValueError):
    """A model's KV heads cannot be split evenly over the ranks."""


def check_heads_divide(config: dict, ranks: int, name: str) -> None:
    """HeadsDoNotDivide (one line) unless tensor parallelism over ``ranks`` gives
    every rank whole KV heads and whole query groups."""
    heads, kv = attention_heads(config)
    if kv % ranks == 0 and heads % ranks == 0:
        return
    fits = [str(n) for n in range(2, kv + 1) if kv % n == 0 and heads % n == 0][:4]
    hint = f"run on {' or '.join(fits)} ranks" if fits else "run it in one process"
    raise HeadsDoNotDivide(
        f"model {name} has {kv} KV heads ({heads} query heads), which do not divide "
        f"over {ranks} ranks: tensor parallelism gives each rank whole KV heads; "
        f"{hint}, or use a model whose KV heads divide by {ranks}"
    )


def model_config(path: str) -> dict:
    """``config.json`` of a local model folder or hub repo (only the JSON files
    are fetched, as mlx-lm's ``sharded_load`` does first)."""
    from mlx_lm.utils import _download

    folder = Path(_download(path, allow_patterns=["*.json"]))
    return json.loads((folder / "config.json").read_text())


def load_sharded(name: Optional[str], group: mx.distributed.Group, pipeline: bool = False,
                 tokenizer_config: Optional[dict] = None, trust_remote_code: bool = False):
    """(model, tokenizer) of this rank: mlx-lm's ``sharded_load`` over ``group``
    (tensor parallel, or pipeline parallel with ``pipeline``), after checking
    that the KV heads divide (HeadsDoNotDivide). ``name``: a packaged model
    (it keeps its shipped layer profile, as ``load_model`` records), a folder
    or a repo."""
    from mlx_lm.utils import sharded_load

    from ..models import DEFAULT_MODEL, PACKAGED_MODELS, resolve_model
    from ..profiles import PACKAGED_ATTR

    name = DEFAULT_MODEL if name is None else name
    path = resolve_model(name)
    if not pipeline:
        check_heads_divide(model_config(path), group.size(), name)
    model, tokenizer = sharded_load(
        path, group if pipeline else None, None if pipeline else group,
        tokenizer_config=tokenizer_config, trust_remote_code=trust_remote_code)
    if name in PACKAGED_MODELS:
        setattr(model, PACKAGED_ATTR, name)
    return model, tokenizer


def collective_stream() -> mx.Stream:
    """Where a small collective runs: NCCL's (``mlx.launch --backend nccl``
    sets NCCL_HOST_IP) on the GPU, the ring backend's on the CPU."""
    return mx.default_stream(mx.gpu) if "NCCL_HOST_IP" in os.environ else mx.cpu


def shared_seed(seed: Optional[int], group: mx.distributed.Group) -> int:
    """Rank 0's seed (a random one when None) on every rank: sampling must pick
    the same token everywhere, or the ranks' sequences part."""
    if seed is None:
        seed = int(mx.random.randint(0, 2**31 - 1, ()).item())
    mine = mx.array(seed if group.rank() == 0 else 0, dtype=mx.int32)
    return int(mx.distributed.all_sum(mine, group=group, stream=collective_stream()).item())


_stages_lock = threading.Lock()


def _stage_keys(cache):
    return cache.positions


def _set_stage_keys(cache, value):
    cache.positions = value


@contextmanager
def pipeline_stages():
    """H2O caches under mlx-lm's pipeline parallelism, while open.

    A pipelined mlx-lm model keeps the send to the next stage in the graph
    through its last layer's cache, ``cache.keys = mx.depends(cache.keys, h)``
    (a prefill chunk evaluates only the cache states). An H2O cache has no
    ``keys``: inside this block its slot positions carry that dependency
    (``H2OKVCache.keys`` reads and sets ``positions``). Not nestable."""
    from ..cache import H2OKVCache

    if not _stages_lock.acquire(blocking=False):
        raise RuntimeError("pipeline_stages is already active")
    attach = "keys" not in vars(H2OKVCache)
    try:
        if attach:
            H2OKVCache.keys = property(_stage_keys, _set_stage_keys)
        yield
    finally:
        if attach:
            del H2OKVCache.keys
        _stages_lock.release()
