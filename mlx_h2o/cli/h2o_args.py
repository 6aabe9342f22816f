"""The H2O flags shared by `generate`, `cache_prompt` and `serve`, checked before
any model loads; config errors in the flags' words (``flagify``).

The budget is mlx-lm's ``--max-kv-size``: in mlx-lm it is the most tokens a
layer's ``RotatingKVCache`` holds, here the most an H2O cache holds (under the
default uniform layer budget), the same bound with a policy that keeps heavy
hitters instead of the newest tokens. With ``--no-h2o`` it is mlx-lm's again.
``--h2o-max-size`` is its older spelling, accepted and not shown by --help.
"""

import argparse
import dataclasses
import re
from typing import Optional, Tuple

from ..config import PREFILL_COMPACT, SCORE_MODES, H2OConfig
from .common import fail

# H2OConfig / QuantConfig fields -> the flags that set them (error messages).
FIELD_FLAGS = {
    "max_size": "--max-kv-size",
    "sink_size": "--h2o-sink-size",
    "heavy_budget": "--h2o-heavy-budget",
    "recent_budget": "--h2o-recent-budget",
    "score": "--h2o-score",
    "prefill_window": "--h2o-prefill-window",
    "prefill_pool": "--h2o-prefill-pool",
    "prefill_compact": "--h2o-prefill-compact",
    "evict_batch": "--h2o-evict-batch",
    "layer_budget": "--h2o-layer-budget",
    "bits": "--h2o-kv-bits",
    "group_size": "--h2o-kv-group-size",
    "recent_bits": "--h2o-kv-recent-bits",
}
# Every --h2o-* option's dest and the value it means when not given.
H2O_DEFAULTS = {
    "h2o_max_size": 256, "h2o_heavy_budget": None, "h2o_recent_budget": None,
    "h2o_sink_size": 4, "h2o_score": None, "h2o_prefill_window": None,
    "h2o_prefill_pool": None, "h2o_prefill_compact": None, "h2o_evict_batch": None,
    "h2o_layer_budget": "uniform", "h2o_kv_bits": None, "h2o_kv_group_size": 64,
    "h2o_kv_recent_bits": None,
}
# The library's defaults, named in the help texts.
_LIB = {f.name: f.default for f in dataclasses.fields(H2OConfig)}


def flagify(message: str) -> str:
    """A config error in the flags' words: ``max_size must be >= 1`` ->
    ``--max-kv-size must be >= 1``. Names without an underscore (``bits``,
    ``score``) are replaced only as ``name=`` (they are ordinary words too)."""
    for field, flag in FIELD_FLAGS.items():
        pattern = rf"\b{field}\b" if "_" in field else rf"\b{field}(?==)"
        message = re.sub(pattern, flag, message)
    return message.replace("leave one budget unset to derive it",
                           "drop --h2o-heavy-budget or --h2o-recent-budget to derive it")


MAX_KV_SIZE_HELP = (
    "KV budget: tokens each attention layer's cache holds at most (default: 256). "
    "Nothing is evicted, and greedy output equals mlx-lm's (dense K/V), while "
    "the conversation has at most N tokens. H2O evicts by attention score{no_h2o}. "
    "Under --h2o-layer-budget auto or a profile, N is the mean over layers "
    "instead (each layer N/4 to 4N)")
_ROTATING = "; with --no-h2o mlx-lm's RotatingKVCache keeps the newest N (unset: unbounded)"


def add_h2o_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("H2O eviction (every default: mlx_h2o.H2OConfig's)")
    own = next((a for a in parser._actions if "--max-kv-size" in a.option_strings), None)
    if own is None:  # mlx_lm.server has no --max-kv-size
        g.add_argument("--max-kv-size", type=int, default=None, metavar="N",
                       help=MAX_KV_SIZE_HELP.format(no_h2o=""))
    else:
        own.help, own.metavar = MAX_KV_SIZE_HELP.format(no_h2o=_ROTATING), "N"
    g.add_argument("--h2o-max-size", type=int, default=None, help=argparse.SUPPRESS)
    g.add_argument("--h2o-heavy-budget", type=int, default=None, metavar="N",
                   help="Heavy-hitter slots (default: half of what sinks leave)")
    g.add_argument("--h2o-recent-budget", type=int, default=None, metavar="N",
                   help="Recent-window slots (default: the rest)")
    g.add_argument("--h2o-sink-size", type=int, default=None, metavar="N",
                   help="Attention-sink positions always kept (default: 4)")
    g.add_argument("--h2o-score", choices=SCORE_MODES, default=None,
                   help=f"Score mode (default: {_LIB['score']})")
    g.add_argument("--h2o-prefill-window", type=int, default=None, metavar="N",
                   help="Score a prompt chunk that overflows the budget by its last N "
                   f"queries only (default: {_LIB['prefill_window']}; 0 = all)")
    g.add_argument("--h2o-prefill-pool", type=int, default=None, metavar="N",
                   help="Max-pool such a chunk's scores over N neighbouring positions "
                   f"(default: {_LIB['prefill_pool']})")
    g.add_argument("--h2o-prefill-compact", choices=PREFILL_COMPACT, default=None,
                   help="Compact an overflowing prompt after each prefill chunk "
                   "('chunk'), scored also by the prompt's end read ahead ('preview') "
                   "or by its end's queries from a first bounded prefill ('two_pass': "
                   "the prompt prefilled twice), or once, at the first decode step, "
                   f"scored by the last chunk ('prompt'; default: {_LIB['prefill_compact']})")
    g.add_argument("--h2o-evict-batch", type=int, default=None, metavar="K",
                   help="A full cache evicts K tokens at once, then appends "
                   "(sliding-window speed; 1 = per-step H2O; default: "
                   f"{_LIB['evict_batch']}; not with --h2o-kv-recent-bits)")
    g.add_argument("--h2o-layer-budget", default=None, metavar="{uniform,auto,PATH}",
                   help="How the budget is shared between layers: 'uniform' = "
                   "--max-kv-size in every layer (default); 'auto' = the shipped layer "
                   "profile of a packaged model (else uniform); or a profile file from "
                   "`mlx-h2o calibrate`. A profile keeps the memory of --max-kv-size "
                   "tokens a layer but gives some layers fewer, which evict sooner")
    g.add_argument("--h2o-kv-bits", type=int, choices=(4, 8), default=None,
                   help="Quantize the kept K/V (QuantizedH2OKVCache; default: dense)")
    g.add_argument("--h2o-kv-group-size", type=int, choices=(32, 64, 128), default=None,
                   help="Quantization group size along head_dim (default: 64)")
    g.add_argument("--h2o-kv-recent-bits", type=int, choices=(4,), default=None,
                   help="Mixed precision: recent window at these bits, the rest "
                   "at --h2o-kv-bits (e.g. 8 heavy / 4 recent)")
    g.add_argument("--no-h2o", action="store_true",
                   help="Plain mlx-lm caches (for comparison); no --h2o-* flag applies")


def given_h2o_flags(args) -> list:
    """The H2O flags given on the command line (their values are not None)."""
    return [_DEST_FLAGS.get(d, "--" + d.replace("_", "-")) for d in H2O_DEFAULTS
            if getattr(args, d) is not None]


_DEST_FLAGS = {"h2o_max_size": "--max-kv-size"}  # the budget's canonical flag


def take_max_kv_size(parser, args, rotating: bool = True) -> None:
    """``--max-kv-size`` (or its old spelling ``--h2o-max-size``) becomes the H2O
    budget (``args.h2o_max_size``); with --no-h2o it stays mlx-lm's
    RotatingKVCache size (``rotating``: the command has one)."""
    n, old = args.max_kv_size, args.h2o_max_size
    if n is not None and old is not None and n != old:
        fail(parser, f"--max-kv-size {n} and --h2o-max-size {old} (its old spelling) "
             "disagree: give --max-kv-size only")
    if args.no_h2o:
        if old is not None:
            fail(parser, f"--h2o-max-size is the H2O budget: with --no-h2o use "
                 f"--max-kv-size {old} (mlx-lm's RotatingKVCache)" if rotating else
                 "--h2o-max-size has no effect with --no-h2o: drop one of them")
        if n is not None and not rotating:
            fail(parser, f"--max-kv-size {n} has no effect with --no-h2o (mlx_lm.server "
                 "has no bounded cache): drop one of them")
        return
    if n is not None:
        args.h2o_max_size, args.max_kv_size = n, None


def h2o_value(args, dest: str):
    value = getattr(args, dest)
    return H2O_DEFAULTS[dest] if value is None else value


def h2o_config_from_args(args) -> Optional[H2OConfig]:
    """The H2OConfig the flags ask for (None with --no-h2o); raises ValueError /
    TypeError in the config's words (``check_h2o_args`` turns them into flags)."""
    if args.no_h2o:
        return None
    options = dict(score=args.h2o_score, prefill_window=args.h2o_prefill_window,
                   prefill_pool=args.h2o_prefill_pool,
                   prefill_compact=args.h2o_prefill_compact,
                   evict_batch=args.h2o_evict_batch)
    budget = h2o_value(args, "h2o_max_size") if args.max_kv_size is None else args.max_kv_size
    return H2OConfig(
        max_size=budget, sink_size=h2o_value(args, "h2o_sink_size"),
        heavy_budget=args.h2o_heavy_budget, recent_budget=args.h2o_recent_budget,
        **{k: v for k, v in options.items() if v is not None},
    )


def quant_config_from_args(args):
    from ..cache.quantized import QuantConfig

    if args.h2o_kv_bits is None:
        if args.h2o_kv_recent_bits is not None:
            raise ValueError("--h2o-kv-recent-bits needs --h2o-kv-bits (e.g. 8)")
        if args.h2o_kv_group_size is not None:
            raise ValueError("--h2o-kv-group-size needs --h2o-kv-bits (4 or 8)")
        return None
    return QuantConfig(bits=args.h2o_kv_bits, group_size=h2o_value(args, "h2o_kv_group_size"),
                       recent_bits=args.h2o_kv_recent_bits)


def check_mlx_lm_cache_flags(parser, args) -> None:
    """--max-kv-size is the H2O budget (``take_max_kv_size``); mlx-lm's
    --kv-bits needs --no-h2o."""
    take_max_kv_size(parser, args)
    if args.no_h2o:
        return
    if args.kv_bits is not None:
        bits = args.kv_bits if args.kv_bits in (4, 8) else 8
        fail(parser, f"--kv-bits quantizes mlx-lm's cache: for a quantized H2O cache use "
             f"--h2o-kv-bits {bits} instead, or add --no-h2o for mlx-lm's")


def check_h2o_args(parser, args) -> Tuple[Optional[H2OConfig], object]:
    """(H2OConfig or None, QuantConfig or None) from the flags; a user error ends
    the command (``fail``)."""
    given = given_h2o_flags(args)
    if args.no_h2o:
        if given:
            fail(parser, f"{given[0]} has no effect with --no-h2o: drop one of them")
        return None, None
    try:
        config = h2o_config_from_args(args)
        quant = quant_config_from_args(args)
    except (ValueError, TypeError) as e:
        fail(parser, flagify(str(e)))
    if quant is not None and quant.mixed and config.evict_batch > 1:
        fail(parser, "--h2o-evict-batch applies to dense and single-precision caches; "
             "mixed precision (--h2o-kv-recent-bits) evicts every step: drop one of them")
    budget = h2o_value(args, "h2o_layer_budget")
    if budget not in ("auto", "uniform"):
        from ..profiles import load_profile

        try:
            load_profile(budget)
        except ValueError as e:
            fail(parser, f"--h2o-layer-budget {budget}: {e}")
    return config, quant
