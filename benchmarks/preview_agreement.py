"""How closely a preview's queries point where the real ones do.

`prefill_compact="preview"` scores every prompt chunk compacted before the
question arrives with queries computed ahead: the prompt's last N tokens run
through the model alone (mlx_h2o.preview_prompt), the last 32 of them handed
on. This measures, for N tokens read, how much of what the real queries
rank highest the preview's queries rank highest too.

For each retrieval prompt (mlx-h2o retrieval's, depth 0.5): the prompt is
prefilled in full (mlx-lm's KVCache, 2,048-token steps) and each layer's
queries of its last 32 tokens recorded, the real ones. Each layer, KV head:
attention of those 32 queries over every prompt key, summed over the queries
and the group's query heads, max-pooled over +-10 positions (the prefill's
pool, policy.pool_neighbours, prefill_pool=21); its top tenth of keys is the
real set. The same for the preview's last 32 queries (N tokens read, at
their true positions, no other context) over the same keys. Printed: the
share of the real set the preview's top tenth holds (recall), the mean over
layers and heads; and the share of the answer's tokens (a value's digits,
where findable) in each top tenth. `--reads 128+4` reads the prompt's first
4 tokens (its sinks) in front of the last 128.

    python benchmarks/preview_agreement.py --model smollm2-135m --haystack austen --context 4096 --tasks single multikey sentence docqa --reads 32 128 128+4 512+4 1024+4
"""

import argparse
import time

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import KVCache

from mlx_h2o import policy
from mlx_h2o.eval.common import load_any
from mlx_h2o.eval.retrieval import haystack_text, make_prompts
from mlx_h2o.integration.routing import patch

W, TOP, POOL, STEP = 32, 0.1, 10, 2048


class Recording(KVCache):
    """mlx-lm's KVCache that keeps the last ``W`` queries of each call."""

    def h2o_attention(self, q, k, v, *, scale, mask=None, sinks=None):
        self.queries, self.scale = q[:, :, -W:], scale
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask, sinks=sinks)


class Ahead:
    """A preview layer: the read tokens' own K/V only (after any sinks'), at
    their true positions (``offset`` drives RoPE, not where they are stored)."""

    def __init__(self):
        self.offset, self.keys, self.values = 0, None, None

    def update_and_fetch(self, k, v):
        self.offset += k.shape[2]
        if self.keys is not None:
            k, v = mx.concatenate([self.keys, k], 2), mx.concatenate([self.values, v], 2)
        self.keys, self.values = k, v
        return k, v

    def h2o_attention(self, q, k, v, *, scale, mask=None, sinks=None):
        self.queries = q[:, :, -W:]  # "causal" aligns the queries with the keys' end
        return mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=mask, sinks=sinks)


def real_queries(body, tokens):
    layers = [Recording() for _ in body.layers]
    with patch():
        for s in range(0, tokens.shape[1], STEP):
            mx.eval(body(tokens[:, s:s + STEP], cache=layers))
    return layers


def preview_queries(body, tokens, read: int, sinks: int):
    """The last W queries after reading the prompt's last ``read`` tokens
    (after its first ``sinks`` tokens, at positions 0.., when sinks > 0)."""
    L = tokens.shape[1]
    layers = [Ahead() for _ in body.layers]
    with patch():
        if sinks:
            body(tokens[:, :sinks], cache=layers)
        for c in layers:  # the read tokens sit at their true positions
            c.offset = L - read
        mx.eval(body(tokens[:, L - read:], cache=layers))
    return [c.queries for c in layers]


def pooled_mass(q, keys, scale):
    """(Hk, L) attention of q (1, Hq, W, D) over keys (1, Hk, L, D), summed
    over queries and the group, max-pooled over +-POOL positions."""
    Hq, Hk = q.shape[1], keys.shape[1]
    qq = q.reshape(1, Hk, (Hq // Hk) * q.shape[2], q.shape[3]).astype(mx.float32)
    p = mx.softmax((qq * scale) @ keys.astype(mx.float32).transpose(0, 1, 3, 2), axis=-1)
    mass = p.sum(axis=2)  # (1, Hk, L)
    positions = mx.broadcast_to(mx.arange(mass.shape[-1]), mass.shape)
    return np.array(policy.pool_neighbours(mass, positions, POOL)[0])


def top_sets(mass, k):
    return [set(np.argsort(-row)[:k]) for row in mass]


def answer_positions(tokenizer, prompt) -> set:
    """Prompt positions inside a run of the answers' tokens (3 of 7 around)."""
    ids = set()
    for a in prompt["answers"]:
        ids |= set(tokenizer.encode(a, add_special_tokens=False))
    t = prompt["tokens"]
    hit = [x in ids for x in t]
    return {i for i in range(len(t) - 64) if hit[i] and sum(hit[max(0, i - 3):i + 4]) >= 3}


def parse_read(spec: str) -> tuple[int, int]:
    read, _, sinks = spec.partition("+")
    return int(read), int(sinks or 0)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--haystack", default="austen")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--tasks", nargs="+", default=["single", "multikey", "sentence", "docqa"])
    p.add_argument("--reads", nargs="+", default=["32", "128"],
                   help="tokens read: N, or N+S with the prompt's first S tokens in front")
    args = p.parse_args()
    reads = [parse_read(r) for r in args.reads]
    model, tokenizer = load_any(args.model)
    body = model.model
    prompts = make_prompts(tokenizer, args.tasks, [args.context], [0.5], seed=args.seed,
                           haystack=haystack_text(args.haystack))
    recall = {r: [] for r in args.reads}
    print(f"# model={args.model} haystack={args.haystack} seed={args.seed} "
          f"context={args.context} queries={W} top={TOP} pool=+-{POOL}", flush=True)
    for prompt in prompts:
        tic = time.perf_counter()
        tokens = mx.array(prompt["tokens"])[None]
        L = tokens.shape[1]
        real = real_queries(body, tokens)
        keys = [c.state[0][:, :, :L] for c in real]
        k = int(TOP * L)
        want = [top_sets(pooled_mass(c.queries, K, c.scale), k) for c, K in zip(real, keys)]
        answer = answer_positions(tokenizer, prompt)

        def answer_share(sets):
            return float(np.mean([[len(answer & s) / max(1, len(answer)) for s in layer]
                                  for layer in sets]))

        line = [f"{prompt['task']:9s} L={L} answer_tokens={len(answer)} "
                f"real: answer_in_top={answer_share(want):.3f}"]
        for spec, (read, sinks) in zip(args.reads, reads):
            qs = preview_queries(body, tokens, read, sinks)
            got = [top_sets(pooled_mass(q, K, c.scale), k) for q, K, c in zip(qs, keys, real)]
            r = float(np.mean([[len(a & b) / k for a, b in zip(g, w)]
                               for g, w in zip(got, want)]))
            recall[spec].append(r)
            line.append(f"read {spec}: recall={r:.3f} answer_in_top={answer_share(got):.3f}")
        print(" | ".join(line) + f" | {time.perf_counter() - tic:.0f}s", flush=True)
    for spec in args.reads:
        print(f"read {spec:>7s}: top-{TOP:g} recall of the real queries' keys, mean over "
              f"{len(prompts)} prompts: {np.mean(recall[spec]):.3f}", flush=True)


if __name__ == "__main__":
    main()
