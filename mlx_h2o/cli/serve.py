"""`mlx-h2o serve`: mlx-lm's OpenAI-compatible server with H2O-bounded KV caches.

Takes every ``mlx_lm.server`` flag plus ``--max-kv-size`` and ``--h2o-*``. Each
request's KV cache holds at most ``--max-kv-size`` tokens per layer (nothing is
evicted while a conversation fits); requests are batched
(continuous batching, BatchH2OKVCache) and finished ones feed the prompt
cache (LRU) compressed. Without ``--model`` it serves the embedded default
model. Responses carry ``usage.h2o``: tokens seen / kept / evicted, KV bytes.

  mlx-h2o serve --max-kv-size 512 --port 8080
  mlx-h2o serve --model mlx-community/Qwen3-4B-4bit --max-kv-size 1024

Under ``mlx.launch`` the model is sharded over the ranks as mlx_lm.server
does it (tensor parallel; ``--pipeline``: pipeline parallel); rank 0 serves
HTTP and every rank keeps H2O caches for its own KV heads (docs/DISTRIBUTED.md).

Stricter than mlx_lm.server: only the model given at start is served, every
request is checked before generation (a bad one gets a 4xx JSON error naming
the field) and bounded by the limit flags; a failed request never stops the
server (docs/SERVING.md, "Limits and safety").
"""

import argparse
import logging
from contextlib import nullcontext
from typing import List, Optional
from unittest import mock

import mlx_lm.server as server

from ..integration.distributed import (
    HeadsDoNotDivide,
    check_heads_divide,
    model_config,
    world,
)
from ..integration.served import ServedModel, ServerLimits
from ..models import DEFAULT_MODEL, PACKAGED_MODELS
from .common import check_model_arg, fail
from .h2o_args import add_h2o_args, check_h2o_args, flagify, h2o_value, take_max_kv_size
from .ranks import check_rank_args, fail_once, is_distributed


class _Built(Exception):
    """Carries mlx_lm.server's parser out of its main()."""


def mlx_lm_server_parser() -> argparse.ArgumentParser:
    """mlx_lm.server's own parser. Its main() builds it inline and parses at
    once: the parser is taken at ``parse_args``, before anything else runs."""

    def take(parser, *args, **kwargs):
        raise _Built(parser)

    with mock.patch.object(argparse.ArgumentParser, "parse_args", take):
        try:
            server.main()
        except _Built as built:
            return built.args[0]
    raise RuntimeError("mlx_lm.server.main() did not build an argument parser")


def setup_arg_parser() -> argparse.ArgumentParser:
    parser = mlx_lm_server_parser()
    parser.prog = "mlx-h2o serve"
    parser.usage = ("mlx-h2o serve [-h] [--model MODEL] [--host HOST] [--port PORT] "
                    "[--h2o-* ...] [mlx_lm.server flags]")
    parser.description = __doc__.splitlines()[0]
    for action in parser._actions:
        if action.dest == "model":
            action.help = f"Model path, hub repo or packaged name (default: {DEFAULT_MODEL})"
    add_h2o_args(parser)
    add_limit_args(parser)
    return parser


def add_limit_args(parser: argparse.ArgumentParser) -> None:
    """What one request may ask of the server (mlx_h2o.integration.served)."""
    d = ServerLimits()
    g = parser.add_argument_group("request limits")
    g.add_argument("--max-body-bytes", type=int, default=d.max_body_bytes,
                   help="largest request body in bytes; a larger one gets 413 (default: "
                   "%(default)s)")
    g.add_argument("--max-prompt-tokens", type=int, default=d.max_prompt_tokens,
                   help="most prompt tokens a request may bring (default: %(default)s)")
    g.add_argument("--max-tokens-limit", type=int, default=d.max_tokens_limit,
                   help="largest max_tokens a request may ask for (default: %(default)s)")
    g.add_argument("--header-timeout", type=float, default=d.header_timeout,
                   help="seconds a client has to send its request line and headers (default: "
                   "%(default)s)")
    g.add_argument("--body-timeout", type=float, default=d.body_timeout,
                   help="seconds a client has to send its body, and may leave its answer "
                   "unread (default: %(default)s)")
    g.add_argument("--allow-remote-images", action="store_true",
                   help="fetch http(s) image URLs of requests (vision models; off: data: "
                   "URLs only)")


def limits_from_args(parser, args) -> ServerLimits:
    """The limit flags as ServerLimits; a bad value ends the command."""
    try:
        limits = ServerLimits(args.max_body_bytes, args.max_prompt_tokens,
                              args.max_tokens_limit, args.header_timeout, args.body_timeout,
                              args.allow_remote_images)
    except ValueError as e:  # "<field> must be ...": the field is the flag's dest
        field, rest = str(e).split(" ", 1)
        fail(parser, f"--{field.replace('_', '-')} {rest}")
    if args.max_tokens > limits.max_tokens_limit or args.max_tokens < 1:
        fail(parser, f"--max-tokens {args.max_tokens}: the default max_tokens must be from 1 "
             f"to --max-tokens-limit ({limits.max_tokens_limit})")
    return limits


def check_args(parser, args):
    """Every user error, before the model loads: (the H2OConfig, None for
    --no-h2o; the ServerLimits)."""
    take_max_kv_size(parser, args, rotating=False)
    if args.kv_bits is not None and not args.no_h2o:
        fail(parser, "--kv-bits quantizes mlx-lm's cache and serves one request at a time; "
             "`mlx-h2o serve` batches dense H2O caches: drop --kv-bits (--max-kv-size "
             "bounds the memory), or add --no-h2o for mlx-lm's")
    config, quant = check_h2o_args(parser, args)
    if quant is not None:
        fail(parser, "--h2o-kv-bits: `mlx-h2o serve` batches dense H2O caches only (its "
             "batch cache is not quantized); drop --h2o-kv-bits and --h2o-kv-*")
    if config is not None and config.evict_batch > 1:
        fail(parser, "--h2o-evict-batch: `mlx-h2o serve` batches caches that evict every "
             "step; drop --h2o-evict-batch")
    check_model_arg(parser, args.model)
    if args.draft_model:
        check_model_arg(parser, args.draft_model, "--draft-model")
    return config, limits_from_args(parser, args)


def _resolve(parser, args) -> Optional[tuple]:
    """``args.model`` as a path or repo mlx-lm loads (packaged models are
    prepared); (name, path) of a packaged model, else None."""
    from ..models import resolve_model

    name = DEFAULT_MODEL if args.model is None else args.model
    try:
        args.model = resolve_model(name)
        if args.draft_model:
            args.draft_model = resolve_model(args.draft_model)
    except (OSError, ValueError) as e:
        fail(parser, f"--model {name}: {e}")
    return (name, args.model) if name in PACKAGED_MODELS else None


def _load_checked(parser, provider, config, layer_budget, group) -> None:
    """Load the served model now (the server reuses it) and build its H2O
    caches once (``config`` None: mlx-lm's caches): an unsupported model or
    layer profile, or (tensor parallel) KV heads that do not divide by the
    ranks end the command."""
    from ..integration.factory import make_h2o_cache

    path = provider.cli_args.model
    packaged = getattr(provider, "packaged", None)
    name = packaged[0] if packaged else path
    try:
        if is_distributed(group) and not provider.cli_args.pipeline:
            check_heads_divide(model_config(path), group.size(), name)
        model, _ = provider.load("default_model", None, "default_model")
    except HeadsDoNotDivide as e:
        fail_once(parser, group, str(e))
    except (OSError, ValueError) as e:
        first = next((l for l in str(e).splitlines() if l.strip()), type(e).__name__)
        fail_once(parser, group, f"--model {name}: could not load it ({first})")
    if config is None:
        return
    try:
        make_h2o_cache(model, config, layer_budget=layer_budget)
    except (ValueError, TypeError) as e:
        fail_once(parser, group, flagify(str(e)))


def main(argv: Optional[List[str]] = None) -> int:
    parser = setup_arg_parser()
    args = parser.parse_args(argv)
    config, limits = check_args(parser, args)
    given = (DEFAULT_MODEL if args.model is None else args.model, args.draft_model)
    group = world()
    check_rank_args(parser, args, group)
    logging.basicConfig(level=getattr(logging, args.log_level.upper(), None),
                        format="%(asctime)s - %(levelname)s - %(message)s")
    packaged = _resolve(parser, args)
    server.maybe_set_recommended_wired_limit()
    from ..integration.distributed import pipeline_stages
    from ..integration.serve import H2OModelProvider, h2o_server, run

    if config is None:  # --no-h2o: mlx-lm's caches, the same checks and limits
        provider = server.ModelProvider(args)
        _load_checked(parser, provider, None, None, group)
        run(args.host, args.port, provider, ServedModel.from_provider(provider, *given), limits)
        return 0
    layer_budget = h2o_value(args, "h2o_layer_budget")
    split = "layers" if args.pipeline else "heads"
    with h2o_server(config, layer_budget, group, split) as tracker, \
            pipeline_stages() if args.pipeline else nullcontext():
        provider = H2OModelProvider(args, packaged)
        _load_checked(parser, provider, config, layer_budget, group)
        if group.rank() == 0:
            logging.info("H2O KV budget: %d tokens per layer, layer budget %s (%s)",
                         config.max_size, layer_budget, config)
        served = ServedModel.from_provider(provider, *given)
        run(args.host, args.port, provider, served, limits, tracker)
    return 0
