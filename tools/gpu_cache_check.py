"""GPU check of the wired H2O cache: its GPU decode paths against the op-by-op path.

    python tools/gpu_cache_check.py [--steps 150]

A random llama (4 layers, 8 / 2 heads, D=64; float32 and float16) decodes
teacher-forced through caches from ``make_h2o_cache`` three ways: the default
(layers grouped: one fold launch for every layer), per-layer fused steps, and
op by op (the reference), at two budgets: 64 (full from the prompt on) and
160 (fills below the budget first). The kept positions and eviction counts
must be equal, the logits equal up to rounding (a near tie may flip a greedy
token: 99% must agree). A line per run; exit 1 on a mismatch, 2 without a GPU
backend. Decode speed is benchmarks/decode_matrix.py's.
"""

import argparse
import sys

import mlx.core as mx
import numpy as np
from mlx_lm.models import llama

import mlx_h2o
from mlx_h2o.cache.decode.fused import FusedStep
from mlx_h2o.cache.decode.grouped import GroupedStep
from mlx_h2o import H2OConfig, make_h2o_cache
from mlx_h2o.kernels import gpu_backend

PATHS = ("group", "fused", "ops")


def tiny_llama(dtype):
    args = dict(
        model_type="llama",
        hidden_size=512,
        num_hidden_layers=4,
        intermediate_size=1024,
        num_attention_heads=8,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        vocab_size=1000,
        head_dim=64,
        tie_word_embeddings=True,
    )
    model = llama.Model(llama.ModelArgs(**args))
    model.set_dtype(dtype)
    mx.eval(model.parameters())
    return model


def on_path(cache, path: str):
    """``cache`` set to decode by ``path``: "group" (the default), "fused"
    (the fused step per layer) or "ops" (op by op). The one place that knows
    the caches' switches."""
    for c in cache:
        if path != "group":
            c.set_decode("reference" if path == "ops" else "fused")
    return cache


def took(cache, path: str) -> bool:
    """Whether the caches really decoded by ``path``."""
    if path == "fused":
        return all(c.decode.find(FusedStep).plan is not None for c in cache)
    if path == "group":
        return all(
            c.decode.find(GroupedStep) is not None
            and c.decode.find(GroupedStep).group._stacked is not None for c in cache
        )
    return all(c.decode.find(FusedStep) is None for c in cache)


def teacher_forced(model, cache, tokens, prefill):
    with mlx_h2o.patch():
        outs = [model(tokens[:, :prefill], cache=cache)[:, -1:]]
        for t in range(prefill, tokens.shape[1]):
            outs.append(model(tokens[:, t : t + 1], cache=cache))
            mx.eval(outs[-1])
    return mx.concatenate(outs, axis=1).astype(mx.float32)


def kept(cache):
    return [np.sort(np.array(c.positions[..., : c.size()]), -1) for c in cache]


def check(dtype, max_size: int, steps: int) -> bool:
    model = tiny_llama(dtype)
    tokens = mx.random.randint(0, 1000, (2, 100 + steps))
    cfg = H2OConfig(max_size=max_size, sink_size=4, heavy_budget=max_size // 2 - 2)
    runs = {}
    for path in PATHS:
        cache = on_path(make_h2o_cache(model, cfg), path)
        out = teacher_forced(model, cache, tokens, 100)
        runs[path] = (out, cache, took(cache, path))
    ref, ref_cache, _ = runs["ops"]
    ok = True
    for path in PATHS[:-1]:
        out, cache, taken = runs[path]
        same_kept = all(
            np.array_equal(a, b) for a, b in zip(kept(cache), kept(ref_cache))
        )
        err = mx.abs(out - ref).max().item()
        agree = (out.argmax(-1) == ref.argmax(-1)).astype(mx.float32).mean().item()
        close = agree >= 0.99 and err <= (1e-2 if dtype == mx.float32 else 2e-2)
        evicted = cache[0].evicted == ref_cache[0].evicted == 100 + steps - max_size
        good = same_kept and evicted and close and taken
        print(
            f"dtype={dtype} max_size={max_size} path={path} taken={taken} "
            f"same_kept={same_kept} evicted={cache[0].evicted} max_logit_err={err:.3g} "
            f"greedy_agree={agree:.3f} -> {'ok' if good else 'MISMATCH'}",
            flush=True,
        )
        ok = ok and good
    return ok


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--steps", type=int, default=150, help="decode steps after the prompt"
    )
    args = p.parse_args()
    if gpu_backend() is None:
        print("no GPU backend (mx.metal / mx.cuda unavailable): nothing to check")
        return 2
    print(f"backend={gpu_backend()} mlx={mx.__version__} steps={args.steps}")
    results = [
        check(dtype, m, args.steps)
        for dtype in (mx.float32, mx.float16)
        for m in (64, 160)
    ]
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
