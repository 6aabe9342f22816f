"""Wall time of a long prompt's prefill under each prompt rule, side by side.

`mlx-h2o generate --verbose` reports mlx-lm's prompt tok/s, timed inside
generate_step: the preview pass (`"preview"`) and the first pass
(`"two_pass"`) run before it and are not in that figure. This times the whole
`mlx_h2o.generate` call for one new token (preview or first pass, prefill,
one decode step), the rules alternated in rounds after a warm-up of each,
and prints each rule's seconds and its ratio to `"chunk"` per round, then the
medians.

    python benchmarks/prefill_rules_speed.py --model smollm2-135m --context 4096 --budget 409 --rounds 3
"""

import argparse
import statistics
import time

import mlx.core as mx

import mlx_h2o
from mlx_h2o.eval.common import load_any
from mlx_h2o.eval.retrieval import haystack_text, make_prompts

RULES = ("chunk", "preview", "two_pass")


def timed(model, tokenizer, prompt, config, step) -> float:
    tic = time.perf_counter()
    mlx_h2o.generate(model, tokenizer, prompt, max_tokens=1, h2o_config=config,
                     prefill_step_size=step)
    mx.synchronize()
    return time.perf_counter() - tic


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--budget", type=int, default=409, help="max_size, tokens a layer")
    p.add_argument("--prefill-step-size", type=int, default=2048)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    model, tokenizer = load_any(args.model)
    prompt = make_prompts(tokenizer, ["single"], [args.context], [0.5],
                          haystack=haystack_text("austen"))[0]["tokens"]
    configs = {r: mlx_h2o.H2OConfig(max_size=args.budget, prefill_compact=r) for r in RULES}
    print(f"# model={args.model} prompt={len(prompt)} tokens budget={args.budget} "
          f"prefill_step={args.prefill_step_size} rounds={args.rounds} backend="
          f"{'gpu' if mx.default_device() == mx.gpu else 'cpu'}", flush=True)
    for r in RULES:  # warm-up: every shape compiled once
        timed(model, tokenizer, prompt, configs[r], args.prefill_step_size)
    ratios = {r: [] for r in RULES}
    for i in range(args.rounds):
        secs = {r: timed(model, tokenizer, prompt, configs[r], args.prefill_step_size)
                for r in RULES}
        for r in RULES:
            ratios[r].append(secs[r] / secs["chunk"])
        print(f"round {i + 1}: " + "  ".join(f"{r} {secs[r]:.2f} s ({secs[r] / secs['chunk']:.3f})"
                                          for r in RULES), flush=True)
    print("median ratio to chunk: " + "  ".join(f"{r} {statistics.median(ratios[r]):.3f}"
                                               for r in RULES), flush=True)


if __name__ == "__main__":
    main()
