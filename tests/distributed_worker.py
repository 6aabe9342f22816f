"""One process of tests/test_distributed.py: a plain process, or one rank under
`mlx.launch` (models sharded over the ranks with mlx-lm's sharded_load).

    python distributed_worker.py LLAMA_DIR QWEN2_DIR PROFILE_JSON OUT_PREFIX

Greedy decoding past the budget, per case of CASES on LLAMA_DIR (tensor
parallel when launched), then "pipeline" on QWEN2_DIR (pipeline parallel when
launched; prefill in chunks that evaluate only the cache states, as mlx-lm's
generate_step does). Writes OUT_PREFIX.<rank>.json: per case the tokens, each
local layer's kept positions ((B, local KV heads, slots), sorted per head) and
the cache stats over all ranks (cache_stats with the group: a collective).
"""

import json
import sys

import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.utils import load

import mlx_h2o
from mlx_h2o import H2OConfig, make_h2o_cache
from mlx_h2o.cache.quantized import QuantConfig, quantized_cache_type
from mlx_h2o.integration.distributed import load_sharded, pipeline_stages, world

PROMPT, STEPS = 41, 12  # a 41-token prompt (past every budget below), 12 greedy steps
CONFIG = H2OConfig(max_size=16, sink_size=2, heavy_budget=6)
CASES = {  # name: (batch rows, H2OConfig, QuantConfig or None, layer budget)
    "dense": (1, CONFIG, None, "uniform"),
    "batch": (2, CONFIG, None, "uniform"),
    "evict_batch": (1, H2OConfig(max_size=16, sink_size=2, heavy_budget=8, evict_batch=4),
                    None, "uniform"),
    "q8_profile": (1, H2OConfig(max_size=16, sink_size=2), QuantConfig(bits=8, group_size=32),
                   "PROFILE"),
}


def prompt(rows: int) -> mx.array:
    return mx.random.randint(0, 1000, (rows, PROMPT), key=mx.random.key(rows))  # (B, L)


def result(cache, tokens, group, split="heads") -> dict:
    kept = [mx.sort(c.state[-3], axis=-1).tolist() for c in cache]  # positions, score, count
    stats = mlx_h2o.cache_stats(cache, group, split)
    return {"tokens": tokens, "kept": kept, "stats": stats.as_dict()}


def run_case(model, rows, config, quant, layer_budget, group) -> dict:
    cache = make_h2o_cache(model, config, quantized_cache_type(quant),
                           layer_budget=layer_budget)
    tokens = []
    with mlx_h2o.patch():
        logits = model(prompt(rows), cache=cache)
        for _ in range(STEPS):
            y = mx.argmax(logits[:, -1], axis=-1, keepdims=True)  # (B, 1)
            tokens.append(y[:, 0].tolist())
            logits = model(y, cache=cache)
    return result(cache, tokens, group)


def run_pipeline(model, group) -> dict:
    cache = make_h2o_cache(model, CONFIG, layer_budget="uniform")
    greedy = lambda logits: mx.argmax(logits, axis=-1)  # noqa: E731
    with mlx_h2o.patch(), pipeline_stages():
        steps = generate_step(prompt(1)[0], model, max_tokens=STEPS, sampler=greedy,
                              prompt_cache=cache, prefill_step_size=16)
        tokens = [[int(token)] for token, _ in steps]
    return result(cache, tokens, group, "layers")


def main(llama: str, qwen2: str, profile: str, out_prefix: str) -> None:
    group = world()
    launched = group.size() > 1
    model = load_sharded(llama, group)[0] if launched else load(llama)[0]
    results = {"ranks": group.size()}
    for name, (rows, config, quant, budget) in CASES.items():
        budget = profile if budget == "PROFILE" else budget
        results[name] = run_case(model, rows, config, quant, budget, group)
    model = load_sharded(qwen2, group, pipeline=True)[0] if launched else load(qwen2)[0]
    results["pipeline"] = run_pipeline(model, group)
    with open(f"{out_prefix}.{group.rank()}.json", "w") as fh:
        json.dump(results, fh)


if __name__ == "__main__":
    main(*sys.argv[1:])
