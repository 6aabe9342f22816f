"""Retrieval prompts in the style of RULER (Hsieh et al. 2024): needles in a haystack.

Tasks (``TASKS``): ``single`` (one key -> 7-digit value), ``multikey`` (the
asked key among 3 distractor keys), ``multivalue`` (one key, 4 values: all
asked), ``multiquery`` (4 keys, 2 asked), ``sentence`` (a sentence needle, "The
best thing to do in <city> is to <activity>."), ``vartrack`` (variable
tracking: a 4-hop chain ``VAR B = VAR A`` from one value; every name asked)
and ``docqa`` (three short company profiles; who founded one of them).

Prompt: [chat template start] INTRO, haystack with the needles at sentence
boundaries, QUESTION [chat template end] ANSWER PREFIX, exactly
``context_len`` tokens (the haystack fills what is left). The haystack is a
text cycled sentence by sentence from a seeded start (``passkey_data``). A
trial is correct when every expected answer appears in the greedy output
(case-insensitive); ``recall`` is the fraction that appears.
"""

from typing import Any, Callable

import numpy as np

from .passkey_data import DEFAULT_FILLER, _filler_tokens, split_sentences
from .windows import encode, special_prefix

TASKS = ("single", "multikey", "multivalue", "multiquery", "sentence", "vartrack", "docqa")
_ADJ = ("quiet", "amber", "brisk", "hollow", "lucky", "silver", "gentle", "rapid", "frozen",
        "violet", "humble", "crimson", "sturdy", "distant", "eager", "polished")
_NOUN = ("falcon", "harbor", "lantern", "meadow", "anchor", "compass", "orchard", "canyon",
         "beacon", "thistle", "glacier", "pebble", "willow", "saddle", "quarry", "ember")
_CITIES = ("Lisbon", "Oslo", "Kyoto", "Denver", "Nairobi", "Halifax", "Tbilisi", "Cusco")
_ACTIVITIES = (
    "eat a sandwich and sit in Dolores Park on a sunny day",
    "rent a bicycle and ride along the old harbor wall at dawn",
    "buy warm pastries and watch the trams climb the hill",
    "climb the bell tower and count the red roofs below",
    "take the night ferry and listen to the fiddlers on deck",
    "visit the glass museum and then swim in the cold lake",
)
_FIRST = ("Clara", "Tomas", "Ingrid", "Rafael", "Mei", "Oskar", "Leila", "Dmitri")
_LAST = ("Winslow", "Okafor", "Lindqvist", "Moreau", "Tanaka", "Halloran", "Petrov", "Achebe")
_ORGS = ("Northwind Glassworks", "Bluefen Cartography", "Ironleaf Bakery",
         "Tidewater Instruments", "Copperline Textiles", "Stonebridge Observatory")

INTRO = ("Some special magic {what} are hidden within the following text. Make sure to "
         "memorize them. I will quiz you about the {what} afterwards.")


def _key(rng) -> str:
    return f"{rng.choice(_ADJ)}-{rng.choice(_NOUN)}"


def _keys(rng, n: int) -> list[str]:
    keys: list[str] = []
    while len(keys) < n:
        k = _key(rng)
        if k not in keys:
            keys.append(k)
    return keys


def _number(rng) -> str:
    return str(int(rng.integers(1_000_000, 10_000_000)))


def _magic(key: str, value: str) -> str:
    return f" One of the special magic numbers for {key} is: {value}."


def _kv_task(rng, n_keys: int, n_values: int, asked: int) -> dict[str, Any]:
    keys = _keys(rng, n_keys)
    values = {k: [_number(rng) for _ in range(n_values)] for k in keys}
    needles = [_magic(k, v) for k in keys for v in values[k]]
    ask = keys[:asked]
    names = " and ".join(ask)
    plural = len(ask) * n_values > 1
    what = "are all the special magic numbers" if plural else "is the special magic number"
    prefix = (f"The special magic number{'s' if plural else ''} for {names} mentioned in the "
              f"provided text {'are' if plural else 'is'}")
    return {"intro": INTRO.format(what="numbers"), "needles": needles,
            "question": f"What {what} for {names} mentioned in the provided text?",
            "prefix": prefix, "answers": [v for k in ask for v in values[k]]}


def _sentence(rng) -> dict[str, Any]:
    city, act = rng.choice(_CITIES), str(rng.choice(_ACTIVITIES))
    words = [w.strip(".,") for w in act.split() if len(w) > 3 and w[0].islower()]
    return {"intro": INTRO.format(what="facts"),
            "needles": [f" The best thing to do in {city} is to {act}."],
            "question": f"What is the best thing to do in {city}?",
            "prefix": f"The best thing to do in {city} is to", "answers": words}


def _vartrack(rng, hops: int = 4) -> dict[str, Any]:
    names: list[str] = []
    while len(names) < hops + 1:
        n = "".join(rng.choice(list("ABCDEFGHJKLMNPQRSTUVWXYZ"), 5))
        if n not in names:
            names.append(n)
    value = str(int(rng.integers(10_000, 100_000)))
    needles = [f" VAR {names[0]} = {value}."]
    needles += [f" VAR {b} = VAR {a}." for a, b in zip(names, names[1:])]
    return {"intro": "Memorize and track the chain(s) of variable assignment hidden in the "
            "following text.", "needles": needles, "ordered": True,
            "question": f"Find all variables that are assigned the value {value} in the "
            "text above.",
            "prefix": f"According to the chain of variable assignment in the text above, "
            f"{hops + 1} variables are assigned the value {value}, they are:",
            "answers": names}


def _docqa(rng) -> dict[str, Any]:
    orgs = [str(o) for o in rng.choice(_ORGS, 3, replace=False)]
    people = [f"{rng.choice(_FIRST)} {rng.choice(_LAST)}" for _ in orgs]
    needles = [f" {o} was founded in {int(rng.integers(1850, 1990))} by {p}, who ran it "
               f"from a small office in {rng.choice(_CITIES)}." for o, p in zip(orgs, people)]
    return {"intro": "Answer the question about the company profiles in the following text.",
            "needles": needles, "question": f"Who founded {orgs[0]}?",
            "prefix": f"{orgs[0]} was founded by", "answers": [people[0]]}


_BUILDERS: dict[str, Callable[[Any], dict[str, Any]]] = {
    "single": lambda rng: _kv_task(rng, 1, 1, 1),
    "multikey": lambda rng: _kv_task(rng, 4, 1, 1),
    "multivalue": lambda rng: _kv_task(rng, 1, 4, 1),
    "multiquery": lambda rng: _kv_task(rng, 4, 1, 2),
    "sentence": _sentence,
    "vartrack": _vartrack,
    "docqa": _docqa,
}


def chat_frame(tokenizer: Any) -> tuple[list[int], list[int]]:
    """Tokens before and after the user message in the model's chat template
    (generation prompt included); ([special prefix], []) without a template."""
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        return special_prefix(tokenizer), []
    mark = "\x00MSG\x00"
    text = tokenizer.apply_chat_template([{"role": "user", "content": mark}], tokenize=False,
                                         add_generation_prompt=True)
    head, tail = text.split(mark)
    return encode(tokenizer, head), encode(tokenizer, tail)


def make_retrieval_prompt(tokenizer: Any, task: str, context_len: int, depth: float,
                          seed: int, haystack: str = DEFAULT_FILLER,
                          chat: bool = True) -> dict[str, Any]:
    """A ``task`` prompt of exactly ``context_len`` tokens (see the module doc).

    ``depth`` places a single needle (0 = start, 1 = end of the haystack);
    several needles go at seeded random depths, in order for ``vartrack``, the
    asked one of ``multikey`` / ``docqa`` at ``depth``. ``chat``: wrap in the
    tokenizer's chat template where it has one.

    Returns:
        {"tokens", "answers", "task", "depth", "seed", "needle_depths"}.
    """
    if task not in _BUILDERS:
        raise ValueError(f"unknown retrieval task {task!r}; use one of {TASKS}")
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must be in [0, 1], got {depth}")
    rng = np.random.default_rng(seed)
    spec = _BUILDERS[task](rng)
    head, tail = chat_frame(tokenizer) if chat else (special_prefix(tokenizer), [])
    head = head + encode(tokenizer, spec["intro"] + "\n\n")
    question = encode(tokenizer, "\n\n" + spec["question"]) + tail
    question += encode(tokenizer, spec["prefix"] if tail else "\n" + spec["prefix"])
    needles = [encode(tokenizer, n) for n in spec["needles"]]
    n_fill = context_len - len(head) - len(question) - sum(map(len, needles))
    if n_fill < 8 * len(needles):
        least = context_len - n_fill + 8 * len(needles)
        raise ValueError(f"context_len={context_len} is too short for task {task!r}: its "
                         "intro, needles, question and some filler take "
                         f"{least} tokens; use a context of at least {least}")
    sentences = split_sentences(haystack)
    if not sentences:
        raise ValueError("haystack text is empty")
    pad, fill, bounds = _filler_tokens(tokenizer, sentences, n_fill,
                                       int(rng.integers(len(sentences))))
    depths = [depth] if len(needles) == 1 else list(rng.uniform(0.05, 0.95, len(needles)))
    if spec.get("ordered"):
        depths.sort()
    elif len(needles) > 1:
        depths[0] = depth
    cuts = [min(bounds, key=lambda b: abs(b - d * len(fill))) for d in depths]
    body, last = list(head + pad), 0
    for i in sorted(range(len(needles)), key=lambda i: (cuts[i], i)):
        body += fill[last:cuts[i]] + needles[i]
        last = cuts[i]
    tokens = body + fill[last:] + question
    return {"tokens": tokens, "answers": spec["answers"], "task": task, "depth": depth,
            "seed": seed, "needle_depths": [float(d) for d in depths]}


def score_output(output: str, answers: list[str]) -> tuple[bool, float]:
    """(every answer appears, fraction that appears), case-insensitive."""
    text = output.lower()
    hits = [a.lower() in text for a in answers]
    return all(hits), sum(hits) / len(hits)
