"""Tiny random-weight models built from mlx-lm's own model classes."""

import mlx.core as mx
from mlx_lm.models import gemma3_text, llama, qwen3

VOCAB = 97


def tiny_llama(seed=0, **kw):
    args = dict(
        model_type="llama", hidden_size=64, num_hidden_layers=2,
        intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
        rms_norm_eps=1e-5, vocab_size=VOCAB, head_dim=16, rope_theta=10000.0,
        tie_word_embeddings=True,
    )
    args.update(kw)
    return _init(llama.Model(llama.ModelArgs(**args)), seed)


def tiny_qwen3(seed=0, **kw):
    args = dict(
        model_type="qwen3", hidden_size=64, num_hidden_layers=2,
        intermediate_size=128, num_attention_heads=4, num_key_value_heads=1,
        rms_norm_eps=1e-6, vocab_size=VOCAB, head_dim=16, rope_theta=10000.0,
        max_position_embeddings=4096, tie_word_embeddings=True,
    )
    args.update(kw)
    return _init(qwen3.Model(qwen3.ModelArgs(**args)), seed)


def tiny_gemma3(seed=0, **kw):
    args = dict(
        model_type="gemma3_text", hidden_size=64, num_hidden_layers=3,
        intermediate_size=128, num_attention_heads=4, num_key_value_heads=1,
        head_dim=16, vocab_size=VOCAB, sliding_window=16, sliding_window_pattern=3,
        query_pre_attn_scalar=16, rope_local_base_freq=10000.0,
    )
    args.update(kw)
    return _init(gemma3_text.Model(gemma3_text.ModelArgs(**args)), seed)


def _init(model, seed):
    # Larger-than-default weights make attention peaky, so eviction matters.
    mx.random.seed(seed)
    from mlx.utils import tree_flatten, tree_unflatten

    params = [
        (k, mx.random.normal(v.shape) * (0.02 if "norm" in k else 0.3))
        for k, v in tree_flatten(model.parameters())
    ]
    model.update(tree_unflatten(params))
    mx.eval(model.parameters())
    return model


BUILDERS = {"llama": tiny_llama, "qwen3": tiny_qwen3, "gemma3_text": tiny_gemma3}


def teacher_forced(model, cache, tokens, prefill):
    """Logits of a prompt of `prefill` tokens, then one decode step per token."""
    import mlx_h2o

    with mlx_h2o.patch():
        outs = [model(tokens[:, :prefill], cache=cache)]
        for t in range(prefill, tokens.shape[1]):
            outs.append(model(tokens[:, t : t + 1], cache=cache))
    return mx.concatenate(outs, axis=1)
