"""`mlx-h2o generate` / `serve` under `mlx.launch`: every rank runs the command,
rank 0 speaks. As mlx-lm's chat and server do, a group of more than one
process loads the model with `sharded_load` (tensor parallel; `--pipeline`:
pipeline parallel) and each rank builds H2O caches for what it holds."""

import sys
from typing import NoReturn

import mlx.core as mx

from .common import fail


def is_distributed(group: mx.distributed.Group) -> bool:
    return group.size() > 1


def fail_once(parser, group: mx.distributed.Group, message: str) -> NoReturn:
    """``fail`` on rank 0 (one line, exit code 2); the other ranks, which meet
    the same error, exit with the same code without repeating it."""
    if group.rank() == 0:
        fail(parser, message)
    sys.exit(2)


def check_rank_args(parser, args, group: mx.distributed.Group) -> None:
    """What a command cannot do under ``mlx.launch``, before anything loads."""
    if not is_distributed(group):
        return
    launched = f"under mlx.launch ({group.size()} ranks)"
    if getattr(args, "adapter_path", None):
        fail_once(parser, group, f"--adapter-path: mlx-lm's sharded_load takes no adapters "
                  f"{launched}; fuse them first (mlx_lm.fuse)")
    if getattr(args, "draft_model", None):
        fail_once(parser, group, f"--draft-model: speculative decoding is not sharded "
                  f"{launched}; drop --draft-model")
    if getattr(args, "prompt_cache_file", None):
        fail_once(parser, group, f"--prompt-cache-file: a cache file holds every KV head, "
                  f"each rank only its own {launched}; run it in one process")
    if getattr(args, "prompt", None) == "-":
        fail_once(parser, group, f"--prompt -: the ranks cannot see the end of stdin "
                  f"{launched}; pass the text: --prompt \"$(cat FILE)\"")


def load_on_ranks(parser, args, group: mx.distributed.Group, name, tokenizer_config=None):
    """(model, tokenizer) of this rank; a model whose KV heads do not divide by
    the ranks, or that mlx-lm cannot shard, ends the command with one line."""
    from ..integration.distributed import HeadsDoNotDivide, load_sharded

    try:
        return load_sharded(name, group, pipeline=getattr(args, "pipeline", False),
                            tokenizer_config=tokenizer_config,
                            trust_remote_code=args.trust_remote_code)
    except HeadsDoNotDivide as e:
        fail_once(parser, group, str(e))
    except (OSError, ValueError) as e:
        first = next((l for l in str(e).splitlines() if l.strip()), type(e).__name__)
        fail_once(parser, group, f"--model {name}: could not load it sharded over "
                  f"{group.size()} ranks ({type(e).__name__}: {first})")
