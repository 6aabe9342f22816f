"""Packaged real models: GGUF conversion (tiny synthetic GGUFs) and the real ones.

The unit tests build tiny GGUF files with `gguf.GGUFWriter` (tests/tiny_gguf.py:
F32 and Q8_0 tensors, a small vocabulary) and need no download. Tests marked
`real_model` prepare the packaged models into the user cache dir (about 820 MB from PyPI
once, or wheels from $MLX_H2O_WHEEL_DIR).
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx_lm
import numpy as np
import pytest
from mlx_lm.models import gemma3_text, llama, qwen2
from tiny_gguf import (
    GEMMA,
    GEMMA_OVERRIDES,
    LLAMA,
    QWEN2,
    make_wheel_spec,
    model_from_weights,
    permute_reference,
    write_tiny_gguf,
)

from mlx_h2o.models import (
    DEFAULT_MODEL,
    PACKAGED_MODELS,
    PackagedModel,
    WheelMember,
    cache_root,
    prepare_model,
    resolve_model,
)
from mlx_h2o.models import prepare as prepare_mod
from mlx_h2o.models.gguf_convert import convert_gguf, open_gguf
from mlx_h2o.models.gguf_llama import llama_cpp_permute, llama_cpp_unpermute

PROSE = Path(__file__).parent / "data" / "python_docs_prose.txt"


# ---------------------------------------------------------------- references
def causal_scores(x, wq, wk, n_heads, n_kv, head_dim, traditional):
    """q.k logits after RoPE, (n_heads, L, L), GQA by repeating K heads."""
    L = x.shape[0]
    q = (x @ wq.T).reshape(1, L, n_heads, head_dim).transpose(0, 2, 1, 3)
    k = (x @ wk.T).reshape(1, L, n_kv, head_dim).transpose(0, 2, 1, 3)
    q = mx.fast.rope(
        q, head_dim, traditional=traditional, base=1e4, scale=1.0, offset=0
    )
    k = mx.fast.rope(
        k, head_dim, traditional=traditional, base=1e4, scale=1.0, offset=0
    )
    k = mx.repeat(k, n_heads // n_kv, axis=1)
    return (q @ k.transpose(0, 1, 3, 2))[0]


@pytest.fixture
def offline_wheels(tmp_path, monkeypatch):
    """A wheel dir in $MLX_H2O_WHEEL_DIR and a cache root in tmp_path."""
    monkeypatch.setenv("MLX_H2O_WHEEL_DIR", str(tmp_path / "wheels"))
    return tmp_path / "cache"


def leftovers(cache):
    return sorted(p.name for p in (cache / "models").glob(".tiny.*-*"))


# ---------------------------------------------------------------- unit tests
@pytest.mark.parametrize("n_head,n_kv", [(9, 3), (4, 4), (8, 1)])
@pytest.mark.parametrize("cols", [(), (24,)])  # a bias, a weight
def test_unpermute_is_inverse_of_llama_cpp_permute(n_head, n_kv, cols):
    rng = np.random.default_rng(n_head * 10 + n_kv)
    head_dim = 16
    wq = rng.standard_normal((n_head * head_dim, *cols)).astype(np.float32)
    wk = rng.standard_normal((n_kv * head_dim, *cols)).astype(np.float32)
    gq, gk = permute_reference(wq, n_head, n_head), permute_reference(wk, n_head, n_kv)
    assert not np.array_equal(gq, wq)  # the test would be vacuous otherwise
    np.testing.assert_array_equal(llama_cpp_unpermute(gq, n_head), wq)
    np.testing.assert_array_equal(llama_cpp_unpermute(gk, n_kv), wk)
    np.testing.assert_array_equal(llama_cpp_permute(wk, n_kv), gk)
    np.testing.assert_array_equal(
        llama_cpp_permute(llama_cpp_unpermute(wq, n_head), n_head), wq
    )


def test_unpermute_turns_interleaved_rope_into_half_rope():
    # llama.cpp's permuted weights with interleaved RoPE (traditional=True) give
    # the same attention logits as the HF weights with mlx-lm's half RoPE.
    rng = np.random.default_rng(1)
    H, KV, hd, D, L = 6, 2, 16, 32, 9
    x = mx.array(rng.standard_normal((L, D)).astype(np.float32))
    wq = rng.standard_normal((H * hd, D)).astype(np.float32)
    wk = rng.standard_normal((KV * hd, D)).astype(np.float32)
    gq, gk = permute_reference(wq, H, H), permute_reference(wk, H, KV)
    args = (H, KV, hd)
    hf = causal_scores(x, mx.array(wq), mx.array(wk), *args, traditional=False)
    gg = causal_scores(x, mx.array(gq), mx.array(gk), *args, traditional=True)
    back = [mx.array(llama_cpp_unpermute(w, n)) for w, n in ((gq, H), (gk, KV))]
    ours = causal_scores(x, *back, *args, traditional=False)
    wrong = causal_scores(x, mx.array(gq), mx.array(gk), *args, traditional=False)
    # float32 matmuls of |logits| ~ 30: agreement to ~1e-5 relative
    np.testing.assert_allclose(np.array(gg), np.array(hf), rtol=1e-4, atol=1e-3)
    np.testing.assert_allclose(np.array(ours), np.array(hf), rtol=1e-4, atol=1e-3)
    assert np.abs(np.array(wrong) - np.array(hf)).max() > 1.0


def test_gemma_norms_subtract_one():
    from mlx_h2o.models import gguf_gemma3

    w = np.random.default_rng(2).standard_normal(8).astype(np.float32)
    for gname, name in [
        ("blk.3.attn_q_norm.weight", "model.layers.3.self_attn.q_norm.weight"),
        (
            "blk.0.post_ffw_norm.weight",
            "model.layers.0.post_feedforward_layernorm.weight",
        ),
        ("output_norm.weight", "model.norm.weight"),
    ]:
        got_name, got = gguf_gemma3.convert_tensor(gname, w + np.float32(1.0), {})
        assert got_name == name
        np.testing.assert_allclose(got, w, atol=1e-6)
    _, same = gguf_gemma3.convert_tensor("blk.0.attn_q.weight", w.reshape(2, 4), {})
    np.testing.assert_array_equal(same, w.reshape(2, 4))


@pytest.mark.parametrize(
    "dims,module,overrides",
    [(LLAMA, llama, {}), (QWEN2, qwen2, {}), (GEMMA, gemma3_text, GEMMA_OVERRIDES)],
    ids=["llama", "qwen2", "gemma3"],
)
def test_tiny_gguf_prepares_to_matching_mlx_lm_model(
    tmp_path, offline_wheels, dims, module, overrides
):
    reference = write_tiny_gguf(tmp_path / "tiny.gguf", dims)
    spec, _ = make_wheel_spec(tmp_path, tmp_path / "tiny.gguf", 3, overrides=overrides)
    path = prepare_model(spec, offline_wheels)
    model, tokenizer = mlx_lm.load(str(path))
    config = json.loads((path / "config.json").read_text())
    expected = model_from_weights(module, config, reference)
    # 13 tokens > the gemma sliding window (4): local and global layers differ
    tokens = mx.array([[5, 17, 42, 100, 7, 3, 250, 9, 64, 31, 12, 77, 200]])
    got, want = model(tokens), expected(tokens)
    # the same float32 weights and ops: equal up to summation order
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-5, atol=1e-5)
    assert config["model_type"] == module.__name__.rsplit(".", 1)[1]
    for key, value in overrides.items():
        assert config[key] == value
    ids = tokenizer.encode("Hello world")
    vocab = tokenizer.get_vocab()
    if dims["arch"] in ("llama", "qwen2"):  # byte-level BPE, no BOS, chat template
        assert ids == [vocab["Hello"], vocab["Ġworld"]]
        assert tokenizer.bos_token == "<|im_start|>" and tokenizer.eos_token_ids == {
            0,
            2,
        }
        chat = tokenizer.apply_chat_template(
            [{"role": "user", "content": "Hi"}],
            add_generation_prompt=True,
            tokenize=False,
        )
        assert chat == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    else:  # sentencepiece, BOS added
        assert ids == [2, vocab["Hello"], vocab["▁world"]]
        assert tokenizer.eos_token_ids == {1, 5}
    assert tokenizer.decode(ids, skip_special_tokens=True) == "Hello world"


def test_qwen2_gguf_without_what_mlx_lm_needs_is_a_clear_error(tmp_path):
    from mlx_h2o.models import gguf_qwen2

    meta = {"qwen2.embedding_length": 64, "qwen2.attention.head_count": 4}
    with pytest.raises(ValueError, match="without Q/K/V biases"):
        gguf_qwen2.make_config(meta, {"blk.0.attn_q.weight"})
    meta["qwen2.attention.key_length"] = 32  # 4 heads x 32 != 64
    with pytest.raises(ValueError, match="head_dim 32 x 4 heads != hidden size 64"):
        gguf_qwen2.make_config(meta, {"blk.0.attn_q.bias"})


def test_prepare_is_cached_and_redone_on_converter_change(
    tmp_path, offline_wheels, monkeypatch
):
    write_tiny_gguf(tmp_path / "tiny.gguf", LLAMA)
    spec, _ = make_wheel_spec(tmp_path, tmp_path / "tiny.gguf")
    path = prepare_model(spec, offline_wheels)
    marker = path / prepare_mod.MARKER_FILE
    stamp = marker.stat().st_mtime_ns
    assert prepare_model(spec, offline_wheels) == path
    assert marker.stat().st_mtime_ns == stamp
    monkeypatch.setattr(
        prepare_mod, "CONVERTER_VERSION", prepare_mod.CONVERTER_VERSION + 1
    )
    assert prepare_model(spec, offline_wheels) == path
    assert (
        json.loads(marker.read_text())["converter_version"]
        == prepare_mod.CONVERTER_VERSION
    )
    assert not (path / "model.gguf").exists() and leftovers(offline_wheels) == []


def test_bad_sha256_is_a_clear_error_and_leaves_nothing(tmp_path, offline_wheels):
    write_tiny_gguf(tmp_path / "tiny.gguf", LLAMA)
    spec, _ = make_wheel_spec(tmp_path, tmp_path / "tiny.gguf", sha256="0" * 64)
    with pytest.raises(ValueError, match="sha256 mismatch"):
        prepare_model(spec, offline_wheels)
    assert not (offline_wheels / "models" / "tiny").exists()
    assert leftovers(offline_wheels) == []


@pytest.mark.parametrize("keep", [0.6, 0.999])
def test_truncated_gguf_is_a_clear_error(tmp_path, offline_wheels, keep):
    write_tiny_gguf(tmp_path / "tiny.gguf", LLAMA)
    data = (tmp_path / "tiny.gguf").read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: int(len(data) * keep)])
    with pytest.raises(ValueError, match="GGUF"):
        convert_gguf(open_gguf(cut))
    spec, _ = make_wheel_spec(tmp_path, cut, sha256=None)
    with pytest.raises(ValueError, match="GGUF|truncated"):
        prepare_model(spec, offline_wheels)
    assert not (offline_wheels / "models" / "tiny").exists()
    assert leftovers(offline_wheels) == []


def test_not_a_gguf_is_a_clear_error(tmp_path):
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file at all" * 100)
    with pytest.raises(ValueError, match="not a valid GGUF"):
        open_gguf(junk)


def test_a_transformers_without_the_gguf_converter_is_a_clear_error(monkeypatch):
    """transformers < 5.18 keeps convert_gguf_tokenizer elsewhere: building a
    tokenizer says which version is needed and how to get it."""
    import types

    from mlx_h2o.models import tokenizer

    name = "transformers.integrations.gguf.gguf_tokenizer_mapping"
    monkeypatch.setitem(sys.modules, name, types.ModuleType(name))  # no converter in it
    with pytest.raises(ImportError, match=r"transformers >= 5.18, found transformers .*"
                                          r"pip install -U 'transformers>=5.18'"):
        tokenizer.build_tokenizer({"tokenizer.ggml.tokens": ["a"]})


def test_unknown_names_are_value_errors(tmp_path):
    with pytest.raises(ValueError, match="smollm2-135m"):
        prepare_model("smollm3", tmp_path)
    with pytest.raises(ValueError, match="gemma3-270m"):
        resolve_model("gemma-270m")
    assert resolve_model("mlx-community/Qwen3-4B-4bit") == "mlx-community/Qwen3-4B-4bit"
    assert resolve_model(str(tmp_path)) == str(tmp_path)
    assert DEFAULT_MODEL == "smollm2-135m" and DEFAULT_MODEL in PACKAGED_MODELS


def test_failed_download_is_a_runtime_error(tmp_path, monkeypatch):
    monkeypatch.delenv("MLX_H2O_WHEEL_DIR", raising=False)
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # fail fast, offline
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path))
    part = WheelMember("mlx-h2o-no-such-package", "0.0.1", "x/model.gguf")
    spec = PackagedModel("missing", "no such model", "MIT", (part,))
    with pytest.raises(RuntimeError, match="MLX_H2O_WHEEL_DIR"):
        prepare_model(spec, tmp_path / "cache")
    assert list((tmp_path / "cache" / "wheels").iterdir()) == []


def test_cache_root_precedence(tmp_path, monkeypatch):
    monkeypatch.delenv("MLX_H2O_CACHE", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_root() == tmp_path / "home" / ".cache" / "mlx-h2o"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_root() == tmp_path / "xdg" / "mlx-h2o"
    monkeypatch.setenv("MLX_H2O_CACHE", str(tmp_path / "mine"))
    assert cache_root() == tmp_path / "mine"
    assert cache_root(tmp_path / "arg") == tmp_path / "arg"


def test_prepare_cli_lists_models(capsys):
    from mlx_h2o.cli.prepare import main

    assert main(["--list"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in PACKAGED_MODELS)


# ---------------------------------------------------------- real models
# Per model: "Hello world" token ids (with BOS for Gemma) and end-of-sequence ids.
REAL = {
    "smollm2-135m": dict(hello=[19556, 905], eos=[0, 2]),
    "gemma3-270m": dict(hello=[2, 9259, 1902], eos=[1, 106]),
    "qwen2.5-coder-0.5b": dict(hello=[9707, 1879], eos=[151643, 151645]),
}
FACT_PROMPT = "The Eiffel Tower is located in the city of"
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


def real_model_report(name):
    """Everything the real-model tests check, computed in one process."""
    model, tokenizer = mlx_lm.load(str(prepare_model(name)))
    hello = tokenizer.encode("Hello world")
    # Perplexity: one forward pass over the first 1024 tokens of the prose.
    ids = mx.array(tokenizer.encode(PROSE.read_text())[:1024])[None]
    logits = model(ids[:, :-1]).astype(mx.float32)
    loss = nn.losses.cross_entropy(logits, ids[:, 1:]).mean().item()
    report = dict(
        hello=hello,
        hello_decoded=tokenizer.decode(hello, skip_special_tokens=True),
        eos=sorted(tokenizer.eos_token_ids),
        ppl=math.exp(loss),
        ppl_tokens=ids.shape[1] - 1,
        greedy=mlx_lm.generate(model, tokenizer, FACT_PROMPT, max_tokens=16),
        has_chat_template=bool(tokenizer.has_chat_template),
    )
    if tokenizer.has_chat_template:
        prompt = tokenizer.apply_chat_template(
            CHAT, add_generation_prompt=True, tokenize=False
        )
        report["chat_prompt"] = prompt
        report["chat"] = mlx_lm.generate(model, tokenizer, prompt, max_tokens=16)
    return report


def run_report(name):
    """`real_model_report(name)`, in a child process with OpenBLAS preloaded
    when it is installed but not loaded here (float32 matmuls ~30x faster)."""
    from mlx_h2o.blas import openblas_active, openblas_path

    lib = openblas_path()
    if lib is None or openblas_active():
        return real_model_report(name)
    env = dict(
        os.environ,
        LD_PRELOAD=":".join(filter(None, [lib, os.environ.get("LD_PRELOAD")])),
    )
    out = subprocess.run(
        [sys.executable, __file__, name], env=env, capture_output=True, text=True
    )
    if out.returncode != 0:
        if "RuntimeError: could not download" in out.stderr:
            raise RuntimeError(out.stderr.strip().splitlines()[-1])
        raise AssertionError(f"report for {name} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module", params=sorted(REAL))
def real(request):
    name = request.param
    try:
        report = run_report(name)  # prepares into the user cache dir, once
    except RuntimeError as e:
        pytest.skip(f"cannot fetch the wheels of {name} (no PyPI access?): {e}")
    print(
        f"\n{name}: "
        + json.dumps({k: v for k, v in report.items() if k != "chat_prompt"})
    )
    return name, report


@pytest.mark.real_model
def test_real_tokenizer(real):
    name, report = real
    assert report["hello"] == REAL[name]["hello"]
    assert report["hello_decoded"] == "Hello world"
    assert report["eos"] == REAL[name]["eos"]


@pytest.mark.real_model
def test_real_perplexity(real):
    # Measured (float32, 1023 tokens): SmolLM2-135M 16.1, Gemma 3 270M 17.0,
    # Qwen2.5-Coder-0.5B 18.0 (a 151,936-token vocabulary: fewer, harder tokens).
    name, report = real
    assert report["ppl_tokens"] == 1023
    assert 5 < report["ppl"] < 40, report["ppl"]


@pytest.mark.real_model
def test_real_greedy_is_coherent(real):
    name, report = real
    assert "Paris" in report["greedy"]


@pytest.mark.real_model
def test_real_chat_template(real):
    name, report = real
    if name == "gemma3-270m":  # a base model: no chat template
        assert not report["has_chat_template"]
        return
    turn = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n"
    assert report["chat_prompt"].endswith(turn + "<|im_start|>assistant\n")
    assert "Paris" in report["chat"]


if __name__ == "__main__":  # used by run_report
    print(json.dumps(real_model_report(sys.argv[1])))
