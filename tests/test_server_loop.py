"""The guarded generation loop of mlx-h2o serve, in process.

A request whose generation fails (a logits processor that raises inside the
batch step, as an out-of-range sampling argument does in mlx-lm) ends with
a 500 error and the next request is answered; stock mlx-lm's loop dies
there. Over HTTP the failure is a 500 JSON error, or (streamed, after the
headers) an error event. A failure that no new request brought ends the
loop (health 503).
Prompts over --max-prompt-tokens, or of no tokens, are refused before they
are queued. Released H2O caches are freed while the server runs.
"""

import gc
import json
import threading
import time
import urllib.error
import urllib.request

import mlx_lm.server as server
import pytest

from mlx_h2o.cli.serve import mlx_lm_server_parser
from mlx_h2o.integration.guarded_generator import GC_INTERVAL, GuardedResponseGenerator
from mlx_h2o.integration.request_scope import as_request_error
from mlx_h2o.integration.request_checks import RequestError
from mlx_h2o.integration.served import ServedModel, ServerLimits
from test_serve import save_tiny_model

FAIL = 13  # a repetition_context_size that marks the request whose step fails


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return str(save_tiny_model(tmp_path_factory.mktemp("loop") / "tiny"))


@pytest.fixture
def generator(model_dir, monkeypatch):
    original = server._make_logits_processors

    def processors(args):
        if args.logits.repetition_context_size != FAIL:
            return original(args)

        def fail(tokens, logits):
            raise RuntimeError("a logits processor failed")

        return [fail]

    monkeypatch.setattr(server, "_make_logits_processors", processors)
    args = mlx_lm_server_parser().parse_args(["--model", model_dir])
    provider = server.ModelProvider(args)
    provider.load("default_model", None, "default_model")
    served = ServedModel.from_provider(provider, model_dir)
    gen = GuardedResponseGenerator(provider, server.LRUPromptCache(4), served,
                                   ServerLimits(max_prompt_tokens=64))
    yield gen
    gen.stop_and_join()


def arguments(context_size=20, seed=None):
    """mlx-lm's generation arguments of a greedy request for 4 tokens."""
    return server.GenerationArguments(
        model=server.ModelDescription("default_model", "default_model", None),
        sampling=server.SamplingArguments(0.0, 1.0, 0, 0.0, 0.0, 0.1),
        logits=server.LogitsProcessorArguments(None, 0.0, context_size, 0.0, 20, 0.0, 20),
        stop_words=[], max_tokens=4, num_draft_tokens=0, logprobs=False, top_logprobs=-1,
        seed=seed, chat_template_kwargs=None)


def ask(gen, prompt, context_size=20, seed=None):
    """The tokens of a greedy text completion of 4 tokens."""
    request = server.CompletionRequest("text", prompt, [], None, None)
    _, responses = gen.generate(request, arguments(context_size, seed))
    return [r.token for r in responses]


@pytest.mark.parametrize("seed", [None, 3], ids=["batched", "served alone"])
def test_a_failed_request_ends_alone_and_the_next_is_served(generator, seed):
    want = ask(generator, "the cat sat on the mat", seed=seed)
    with pytest.raises(Exception) as e:  # what the HTTP handler answers with a 500
        ask(generator, "the cat sat on the mat", context_size=FAIL, seed=seed)
    assert as_request_error(e.value).status == 500 and generator.is_healthy
    assert ask(generator, "the cat sat on the mat", seed=seed) == want


def test_a_failure_no_request_brought_ends_the_loop(generator, monkeypatch):
    def broken():
        raise RuntimeError("the model cannot be loaded any more")

    monkeypatch.setattr(generator.model_provider, "load_default", broken)
    with pytest.raises(RequestError):
        ask(generator, "the cat", context_size=FAIL)
    generator._generation_thread.join(timeout=30)
    assert not generator.is_healthy
    with pytest.raises(RuntimeError, match="generation thread died"):
        ask(generator, "the cat")


def test_prompts_are_bounded_before_they_are_queued(generator):
    with pytest.raises(RequestError) as e:
        ask(generator, "the cat sat " * 40)
    assert e.value.code == "context_length_exceeded" and "at most 64" in str(e.value)
    assert generator.requests.empty()
    assert len(ask(generator, "the cat sat " * 10)) == 4


def test_released_h2o_caches_are_freed_while_serving(model_dir):
    """A released H2OKVCache waits for Python's cyclic collector; with the
    automatic one off, only the generator's own collections free them: what
    stays alive is what the prompt cache (2 entries here) holds, and the last
    request's caches (its response, still in the loop's hands)."""
    from mlx_h2o import H2OConfig, H2OKVCache
    from mlx_h2o.integration.serve import H2OResponseGenerator, h2o_server

    args = mlx_lm_server_parser().parse_args(["--model", model_dir])
    gc.collect()
    gc.disable()
    try:
        with h2o_server(H2OConfig(max_size=16), "uniform") as tracker:
            provider = server.ModelProvider(args)
            provider.load("default_model", None, "default_model")
            served = ServedModel.from_provider(provider, model_dir)
            gen = H2OResponseGenerator(provider, server.LRUPromptCache(2), tracker, served,
                                       ServerLimits())
            try:
                for i in range(8):  # distinct prompts: the prompt cache evicts
                    assert len(ask(gen, f"{i} the cat sat on the mat " * 4)) == 4
                time.sleep(2 * GC_INTERVAL)  # the loop idles: its last collection
                live = sum(isinstance(o, H2OKVCache) for o in gc.get_objects())
                layers = len(provider.model.layers)
                held = len(gen.prompt_cache) * layers
            finally:
                gen.stop_and_join()
    finally:
        gc.enable()
    assert held > 0 and live <= held + layers  # (without the collections: 82 here)



@pytest.fixture
def http_port(generator):
    """``generator`` behind the guarded HTTP handler on 127.0.0.1 (in process)."""
    from mlx_h2o.integration.guarded_handler import GuardedAPIHandler, GuardedHTTPServer

    httpd = GuardedHTTPServer(("127.0.0.1", 0),
                              lambda *a, **k: GuardedAPIHandler(generator, *a, **k))
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield httpd.server_address[1]
    httpd.shutdown()
    httpd.server_close()


def post(port, body):
    """(status, body bytes) of a text completion."""
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions",
                                     data=json.dumps(body).encode())
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def test_a_failed_generation_is_answered_with_an_error(http_port):
    body = {"prompt": "the cat sat", "max_tokens": 4, "repetition_penalty": 1.1,
            "repetition_context_size": FAIL}
    status, data = post(http_port, body)
    assert status == 500 and json.loads(data)["error"]["code"] == "generation_failed"
    status, data = post(http_port, dict(body, stream=True))  # headers sent: an error event
    events = [l for l in data.decode().splitlines() if l.startswith("data: ")]
    assert status == 200 and json.loads(events[-1][6:])["error"]["code"] == "generation_failed"
    assert "data: [DONE]" not in events
    status, data = post(http_port, dict(body, repetition_context_size=20))
    assert status == 200 and json.loads(data)["usage"]["completion_tokens"] >= 1


def test_prompts_with_images_are_checked_by_the_loop(generator):
    """Images are prepared on the generation loop's thread; what it refuses
    there (here: image parts for a text-only model) is the request's 400."""
    request = server.CompletionRequest("chat", "", [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
        {"type": "text", "text": "what is it?"}]}], None, None)
    with pytest.raises(RequestError) as e:
        generator.generate(request, arguments())
    assert e.value.status == 400 and e.value.param == "messages"
    assert generator.is_healthy and len(ask(generator, "the cat")) == 4
