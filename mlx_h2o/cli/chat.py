"""`mlx-h2o chat`: mlx_lm.chat with an H2O-bounded KV cache.

Takes every ``mlx_lm.chat`` flag plus ``--h2o-*``. As in mlx_lm.chat, the
conversation lives in the KV cache: each turn sends only the new message,
so however long the conversation runs, its cache holds at most the budget
(H2O evicts the tokens attention uses least, not whole turns). Without
``--model`` it runs the embedded default model.

At the prompt: q quits, r resets the conversation, s prints the cache
stats, h lists these. ``--stats`` prints the stats after every answer.
Standard input may be a pipe: one message a line, the end of input quits.
"""

import argparse
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, List, Optional

import mlx.core as mx
from mlx_lm.chat import setup_arg_parser as mlx_lm_arg_parser

from ..integration.distributed import shared_seed, world
from ..models import DEFAULT_MODEL
from .common import check_model_arg, fail, load_model_or_fail
from .h2o_args import add_h2o_args, check_h2o_args, flagify, h2o_value, take_max_kv_size
from .ranks import check_rank_args, fail_once, is_distributed, load_on_ranks

HELP = "commands: q exit, r reset the conversation, s cache stats, h help"


def setup_arg_parser() -> argparse.ArgumentParser:
    parser = mlx_lm_arg_parser()
    parser.prog = "mlx-h2o chat"
    parser.description = __doc__.splitlines()[0]
    parser.set_defaults(model=None)
    for action in parser._actions:
        if action.dest == "model":
            action.help = f"Model path, hub repo or packaged name (default: {DEFAULT_MODEL})"
    parser.add_argument("--stats", action="store_true",
                        help="Print the H2O cache stats after every answer")
    add_h2o_args(parser)
    return parser


def check_args(parser, args):
    """Every user error, before anything loads: (H2OConfig or None, QuantConfig or None)."""
    take_max_kv_size(parser, args)  # the H2O budget; mlx-lm's rotating size with --no-h2o
    config, quant = check_h2o_args(parser, args)
    check_model_arg(parser, args.model)
    return config, quant


@dataclass
class Conversation:
    """One conversation's KV cache and how each turn is generated."""

    model: Any
    tokenizer: Any
    make_cache: Callable[[], List[Any]]
    args: argparse.Namespace
    cache: List[Any] = field(init=False)

    def __post_init__(self):
        self.reset()

    def reset(self) -> None:
        self.cache = self.make_cache()

    def reply(self, query: str) -> Iterator[Any]:
        """mlx-lm's ``GenerationResponse`` per token of the answer to ``query``."""
        from mlx_lm.sample_utils import make_sampler

        from ..integration.generate import stream_generate

        args, tokenizer = self.args, self.tokenizer
        messages = [{"role": "system", "content": args.system_prompt}] \
            if args.system_prompt is not None else []
        messages.append({"role": "user", "content": query})
        prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        sampler = make_sampler(
            args.temp, args.top_p, xtc_threshold=args.xtc_threshold,
            xtc_probability=args.xtc_probability,
            xtc_special_tokens=tokenizer.encode("\n") + list(tokenizer.eos_token_ids))
        yield from stream_generate(self.model, tokenizer, prompt, max_tokens=args.max_tokens,
                                   sampler=sampler, prompt_cache=self.cache,
                                   prefill_step_size=args.prefill_step_size)

    def stats(self, group: Optional[mx.distributed.Group] = None) -> str:
        """The cache stats line (a collective under mlx.launch)."""
        if not any(hasattr(c, "h2o_attention") for c in self.cache):
            return "no H2O cache (--no-h2o): mlx-lm's caches hold every token"
        from ..integration.stats import cache_stats

        pipeline = getattr(self.args, "pipeline", False)
        return cache_stats(self.cache, group, "layers" if pipeline else "heads").summary()


def _cache_maker(parser, args, model, config, quant, group) -> Callable[[], List[Any]]:
    """A function that makes a fresh cache for ``model``; checked once here."""
    if config is None:
        from mlx_lm.models.cache import make_prompt_cache

        return lambda: make_prompt_cache(model, args.max_kv_size)
    from ..cache.quantized import quantized_cache_type
    from ..integration.factory import make_h2o_cache

    cache_type = quantized_cache_type(quant)
    budget = h2o_value(args, "h2o_layer_budget")

    def make():
        return make_h2o_cache(model, config, cache_type, layer_budget=budget)

    try:
        make()
    except (ValueError, TypeError) as e:
        fail_once(parser, group, flagify(str(e)))
    return make


def _read(prompt: str) -> Optional[str]:
    """A line of input; None at its end. Piped lines are echoed, so that the
    transcript shows what was asked."""
    try:
        line = input(prompt)
    except EOFError:
        return None
    if prompt and not sys.stdin.isatty():
        print(line)
    return line


def _say(group: mx.distributed.Group, *args, **kwargs) -> None:
    if group.rank() == 0:
        print(*args, **kwargs)


def chat(conversation: Conversation, group: mx.distributed.Group, stats: bool,
         read: Callable[[str], Optional[str]] = _read) -> None:
    """The prompt loop: commands and turns until q or the end of input."""
    while True:
        query = read(">> " if group.rank() == 0 else "")
        if query is None or query.strip() == "q":
            _say(group, "\nbye" if query is None else "bye")
            return
        command = query.strip()
        if command == "r":
            conversation.reset()
            _say(group, "reset: the conversation starts again")
        elif command == "h":
            _say(group, HELP)
        elif command == "s":
            line = conversation.stats(group)
            _say(group, line)
        elif command:
            last = None
            for last in conversation.reply(query):
                _say(group, last.text, end="", flush=True)
            _say(group)
            if last is not None:
                _say(group, f"[{last.generation_tokens} tokens, {last.generation_tps:.1f} "
                     f"tok/s, prompt {last.prompt_tps:.1f} tok/s, peak "
                     f"{last.peak_memory:.2f} GB]")
            if stats:
                line = conversation.stats(group)
                _say(group, line)


def main(argv: Optional[List[str]] = None) -> int:
    parser = setup_arg_parser()
    args = parser.parse_args(argv)
    config, quant = check_args(parser, args)
    group = world()
    check_rank_args(parser, args, group)
    mx.random.seed(shared_seed(args.seed, group) if is_distributed(group) else args.seed)
    tokenizer_config = {"trust_remote_code": args.trust_remote_code}
    if is_distributed(group):
        model, tokenizer = load_on_ranks(parser, args, group, args.model, tokenizer_config)
    else:
        model, tokenizer = load_model_or_fail(parser, args.model, adapter_path=args.adapter_path,
                                              tokenizer_config=tokenizer_config)
    make_cache = _cache_maker(parser, args, model, config, quant, group)
    conversation = Conversation(model, tokenizer, make_cache, args)
    budget = "mlx-lm's caches (--no-h2o)" if config is None else (
        f"H2O, --max-kv-size {config.max_size}, layer budget "
        f"{h2o_value(args, 'h2o_layer_budget')}")
    _say(group, f"mlx-h2o chat: {args.model or DEFAULT_MODEL}, {budget}, max tokens "
         f"{args.max_tokens}\n{HELP}")
    chat(conversation, group, args.stats)
    return 0
