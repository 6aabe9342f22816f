"""A real `mlx-h2o serve` on 127.0.0.1 against hostile and malformed clients.

The tiny random llama of test_serve.py (SmolLM2's tokenizer) is served with
short limits. Every case of benchmarks/hostile_cases.py (benchmarks/
hostile_clients.py sends the same cases to stock mlx_lm.server too) must get the answer
mlx-h2o serve should give: the HTTP status, the field it names, within a
second (the timeout cases within their timeout), and afterwards a normal
request must get the answer it got at start. A client that leaves must stop
its generation; the server is stopped at the end of the module.
"""

import importlib.util
import json
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from test_serve import Server, save_tiny_model

CASES = Path(__file__).resolve().parents[1] / "benchmarks" / "hostile_cases.py"
TIMEOUT = 1.0  # --header-timeout and --body-timeout
PROMPT_LIMIT = 256
LONG = 3000  # tokens asked for by the clients that leave: seconds of decoding


def load_cases():
    spec = importlib.util.spec_from_file_location("hostile_cases", CASES)
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("hostile_cases", module)  # its dataclasses look it up
    spec.loader.exec_module(module)
    return module


hostile = load_cases()


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(server, context, the normal request's answer at start)."""
    tmp = tmp_path_factory.mktemp("hostile")
    model = str(save_tiny_model(tmp / "tiny"))
    srv = Server(["-m", "mlx_h2o", "serve", "--model", model, "--max-kv-size", "64",
                  "--h2o-layer-budget", "uniform", "--max-tokens", "8",
                  "--header-timeout", str(TIMEOUT), "--body-timeout", str(TIMEOUT),
                  "--max-prompt-tokens", str(PROMPT_LIMIT), "--max-tokens-limit", str(LONG)],
                 tmp / "h2o.log")
    listener = hostile.Listener()
    listener.start()
    try:
        srv.wait_ready()
        from serve_model import model_info  # beside hostile_cases.py, on its path

        _, eos, _, _ = model_info(Path(model))
        ctx = hostile.Context(srv.port, "tiny", eos, PROMPT_LIMIT, wait=10, listener=listener,
                              long_answer=LONG)
        reference, _ = hostile.normal(ctx)
        assert reference
        yield srv, ctx, reference
    finally:
        listener.sock.close()
        srv.stop()


@pytest.mark.parametrize("case", hostile.CASES, ids=[c.name for c in hostile.CASES])
def test_each_case_is_answered_and_the_server_keeps_serving(served, case):
    srv, ctx, reference = served
    out = case.run(ctx)
    assert hostile.as_expected(case, out), (out.describe(), out.body[:300])
    waits = TIMEOUT if case.expect in (None, 408) else 0.0
    if not case.name.startswith("client leaves"):
        assert out.seconds < waits + 1.0
    if case.name == "remote image_url":
        assert out.note == "not fetched"
    answer, _ = hostile.normal(ctx)
    assert answer == reference
    assert "generation thread died" not in srv.log_path.read_text()


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_leaves_stops_its_generation(served, stream):
    """Without the stop, the next request (served alone: a seed) would wait
    for the rest of the 3000 tokens the client that left asked for."""
    srv, ctx, _ = served
    out = hostile.leaves(stream)(ctx)
    assert out.status == 200 and out.seconds < 3.0, out.describe()
    assert "client left before its answer was complete" in srv.log_path.read_text()


def test_models_lists_what_is_served(served):
    srv, _, _ = served
    with urllib.request.urlopen(srv.url("/v1/models"), timeout=10) as r:
        listed = json.loads(r.read())
    assert listed["object"] == "list"
    assert [(m["id"], m["object"]) for m in listed["data"]] == [("tiny", "model")]
    with urllib.request.urlopen(srv.url("/v1/models/tiny"), timeout=10) as r:
        assert json.loads(r.read())["id"] == "tiny"
    text, _, usage = srv.ask("chat", [{"role": "user", "content": "hi"}], model="tiny",
                             max_tokens=2)
    assert usage["completion_tokens"] >= 1


def test_health_tells_the_mlx_memory(served):
    srv, _, _ = served
    with urllib.request.urlopen(srv.url("/health"), timeout=10) as r:
        health = json.loads(r.read())
    memory = health["mlx_memory"]
    assert health["status"] == "ok" and set(memory) == {"active", "cache", "peak"}
    assert 0 < memory["active"] <= memory["peak"]


def test_answers_name_the_model_served(served):
    srv, _, _ = served
    body = {"prompt": "the cat", "max_tokens": 2}
    assert srv.post("/v1/completions", body)["model"] == "tiny"
    start = time.monotonic()
    assert srv.post("/v1/completions", dict(body, model="default_model"))["model"] == "tiny"
    assert time.monotonic() - start < 10


def test_no_h2o_serves_mlx_lm_caches_under_the_same_checks(tmp_path):
    model = str(save_tiny_model(tmp_path / "tiny"))
    srv = Server(["-m", "mlx_h2o", "serve", "--no-h2o", "--model", model, "--max-tokens", "4"],
                 tmp_path / "plain.log")
    try:
        srv.wait_ready()
        ctx = hostile.Context(srv.port, "tiny", [], 32768, wait=10)
        out = hostile.ask(stop=123)(ctx)
        assert out.status == 400 and out.error()["param"] == "stop"
        text, finish, usage = srv.ask("chat", [{"role": "user", "content": "hi"}])
        assert finish in ("length", "stop") and "h2o" not in usage
        with urllib.request.urlopen(srv.url("/v1/models"), timeout=10) as r:
            assert json.loads(r.read())["data"][0]["id"] == "tiny"
    finally:
        srv.stop()
