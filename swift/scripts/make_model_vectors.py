"""Write swift/Tests/ModelVectors/tiny_llama.json: greedy tokens of a tiny Llama with H2O caches.

mlx-lm's Llama (2 layers, GQA 4/2 heads, head dim 16, vocab 97, untied head) gets weights
from an integer formula that the Swift test computes the same way (exact in
float32: multiples of 2^-9 times a power of two), so no weight file is needed.
It prefills a prompt longer than the budget (compaction) and decodes greedily
through ``mlx_h2o.patch()`` with ``make_h2o_cache(..., layer_budget="uniform")``;
the file holds the tokens, each step's top-two logit gap (the script fails
below MARGIN, so float32 rounding cannot flip a token) and every layer's slot
positions and metaState at the end. MLXH2OTests decodes the same model with mlx-swift-lm's
LlamaModel through ``attentionWithCacheUpdate`` and the Swift H2O caches.

Usage: python swift/scripts/make_model_vectors.py [--out swift/Tests/ModelVectors]
"""

import argparse
import json
import os

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten
from mlx_lm.models import llama

import mlx_h2o
from mlx_h2o import H2OConfig, make_h2o_cache

FORMAT = "mlx-h2o-swift-model/1"
OUT = os.path.join(os.path.dirname(__file__), "..", "Tests", "ModelVectors")
MARGIN = 1e-3
GAIN = 3  # matrices at 2^GAIN / sqrt(fan_in): varied tokens, sharp attention
ARGS = {
    "model_type": "llama",
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "rms_norm_eps": 1e-5,
    "vocab_size": 97,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
}
H2O = {"max_size": 8, "sink_size": 1, "heavy_budget": 3, "recent_budget": 4, "score": "ema"}
PROMPT = [38, 83, 53, 3, 74, 70, 82, 17, 8, 83, 2, 52]
DECODE = 24


def weight(index: int, shape) -> np.ndarray:
    """Parameter number `index` (sorted names): a 64-bit integer hash scaled to [-1, 1) * 2^-k.

    Norm weights (1-D) are 1 + that / 8; matrices scale by the power of two
    nearest 1 / sqrt(fan_in)."""
    n = int(np.prod(shape))
    x = (np.arange(1, n + 1, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
         + np.uint64(index) * np.uint64(0xBF58476D1CE4E5B9))  # wraps, as Swift's &* and &+
    x ^= x >> np.uint64(31)
    h = ((x >> np.uint64(40)) % np.uint64(1024)).astype(np.float64) / 512 - 1
    if len(shape) == 1:
        return (1 + h / 8).astype(np.float32).reshape(shape)
    scale = 2.0 ** (GAIN - round(np.log2(np.sqrt(shape[-1]))))
    return (h * scale).astype(np.float32).reshape(shape)


def tiny_llama() -> llama.Model:
    model = llama.Model(llama.ModelArgs(**ARGS))
    names = sorted(tree_flatten(model.parameters()))
    params = [(k, mx.array(weight(i, v.shape))) for i, (k, v) in enumerate(names)]
    model.update(tree_unflatten(params))
    mx.eval(model.parameters())
    return model


def decode(model) -> dict:
    cache = make_h2o_cache(model, H2OConfig(**H2O), layer_budget="uniform")
    tokens, gaps = [], []
    x = mx.array([PROMPT])
    with mlx_h2o.patch():
        for _ in range(DECODE):
            logits = model(x, cache=cache)[0, -1].astype(mx.float32)
            top = np.sort(np.array(logits))[-2:]
            tok = int(mx.argmax(logits).item())
            gaps.append(float(top[1] - top[0]))
            tokens.append(tok)
            x = mx.array([[tok]])
    if min(gaps) < MARGIN:
        raise SystemExit(f"a top-two logit gap is {min(gaps):.2e} < {MARGIN}: change the prompt")
    positions = [np.array(c.state[-3]).tolist() for c in cache]
    return {"tokens": tokens, "gaps": [round(g, 4) for g in gaps], "positions": positions,
            "meta_state": [list(c.meta_state) for c in cache]}


def document() -> dict:
    mx.set_default_device(mx.cpu)
    model = tiny_llama()
    # The first values of every parameter, so the Swift test checks the formula itself.
    probe = {k: np.array(v).reshape(-1)[:4].tolist() for k, v in tree_flatten(model.parameters())}
    return {"format": FORMAT, "model": ARGS, "h2o": H2O, "prompt": PROMPT, "weights": probe,
            **decode(model)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=OUT, help="output folder")
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "tiny_llama.json")
    with open(path, "w") as f:
        f.write(json.dumps(document(), separators=(",", ":")) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
