"""The request checks of mlx-h2o serve (mlx_h2o.integration.request_checks),
without a server: the body mlx-lm's handler gets for a good request, and the
status and field of each refusal."""

import math

import pytest

from mlx_h2o.integration.request_checks import RequestError, check_request
from mlx_h2o.integration.served import ServedModel, ServerLimits

SERVED = ServedModel(name="smollm2-135m", vocab_size=49152,
                     aliases=frozenset({"/models/smollm2-135m"}))
VISION = ServedModel(name="vlm", vocab_size=1000, vision=True)
LIMITS = ServerLimits(max_prompt_tokens=1000, max_tokens_limit=100)


def chat(**extra):
    return {"messages": [{"role": "user", "content": "hi"}], **extra}


def refused(body, kind="chat", served=SERVED, limits=LIMITS) -> RequestError:
    with pytest.raises(RequestError) as e:
        check_request(kind, body, served, limits)
    return e.value


def test_a_good_request_reaches_mlx_lm_in_its_types():
    body = chat(model="smollm2-135m", stop="\n", temperature=None, max_tokens=100,
                stream=True, stream_options={}, logit_bias={"007": -5, "49151": 2},
                xtc_probability=1, xtc_threshold=0, top_k=49151, seed=2**64 - 1)
    out = check_request("chat", body, SERVED, LIMITS)
    assert out["model"] == out["draft_model"] == "default_model"
    assert out["stop"] == ["\n"] and "temperature" not in out  # null: the default
    assert out["stream_options"] == {"include_usage": False}
    assert out["logit_bias"] == {"7": -5.0, "49151": 2.0}
    assert type(out["xtc_probability"]) is float and type(out["xtc_threshold"]) is float
    for name in ("/models/smollm2-135m", "default_model"):  # the path given at start, mlx-lm's
        assert check_request("chat", chat(model=name), SERVED, LIMITS)["model"] == "default_model"
    assert check_request("text", {"prompt": "x", "stream_options": "ignored"}, SERVED,
                         LIMITS) == {"prompt": "x", "model": "default_model",
                                     "draft_model": "default_model"}


@pytest.mark.parametrize("extra, param", [
    ({"logit_bias": {"49152": 1}}, "logit_bias"),  # one past the vocabulary
    ({"logit_bias": {"-1": 1}}, "logit_bias"),
    ({"logit_bias": {"1.5": 1}}, "logit_bias"),
    ({"logit_bias": {"1": math.nan}}, "logit_bias"),
    ({"logit_bias": {"1": True}}, "logit_bias"),
    ({"logit_bias": [1]}, "logit_bias"),
    ({"stop": 123}, "stop"), ({"stop": [1, 2]}, "stop"), ({"stop": [None]}, "stop"),
    ({"stop": ""}, "stop"), ({"stop": ["a"] * 17}, "stop"),
    ({"temperature": math.nan}, "temperature"), ({"temperature": math.inf}, "temperature"),
    ({"temperature": -0.1}, "temperature"), ({"temperature": "hot"}, "temperature"),
    ({"top_p": 1.5}, "top_p"), ({"min_p": -1}, "min_p"),
    ({"top_k": 49152}, "top_k"), ({"top_k": 2.0}, "top_k"),
    ({"xtc_threshold": 0.6}, "xtc_threshold"),
    ({"max_tokens": 101}, "max_tokens"), ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": True}, "max_tokens"), ({"max_completion_tokens": 10**9},
                                           "max_completion_tokens"),
    ({"seed": -1}, "seed"), ({"seed": 2**64}, "seed"),
    ({"repetition_context_size": 1101}, "repetition_context_size"),
    ({"num_draft_tokens": 101}, "num_draft_tokens"),
    ({"top_logprobs": 12}, "top_logprobs"), ({"logprobs": "yes"}, "logprobs"),
    ({"stream": 1}, "stream"),
    ({"stream": True, "stream_options": "x"}, "stream_options"),
    ({"stream": True, "stream_options": {"include_usage": "yes"}},
     "stream_options.include_usage"),
    ({"draft_model": "/etc"}, "draft_model"), ({"adapters": "/tmp"}, "adapters"),
    ({"chat_template_kwargs": {"tokenize": False}}, "chat_template_kwargs"),
    ({"chat_template_kwargs": {"chat_template": "{{ x }}"}}, "chat_template_kwargs"),
    ({"chat_template_kwargs": "x"}, "chat_template_kwargs"),
    ({"tools": [1]}, "tools"), ({"role_mapping": {"user": 1}}, "role_mapping"),
])
def test_each_bad_field_is_refused_by_name(extra, param):
    error = refused(chat(**extra))
    assert error.status == 400 and error.param == param and param in str(error)


@pytest.mark.parametrize("messages, param", [
    (None, "messages"), ([], "messages"), ("hi", "messages"), ([1], "messages[0]"),
    ([{"content": "hi"}], "messages[0].role"), ([{"role": 1}], "messages[0].role"),
    ([{"role": "user", "content": 5}], "messages[0].content"),
    ([{"role": "user", "content": [{"type": "audio"}]}], "messages[0].content[0].type"),
    ([{"role": "user", "content": [{"type": "text", "text": 1}]}],
     "messages[0].content[0].text"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:x"}}]}],
     "messages[0].content[0].type"),  # a text-only model
    ([{"role": "user", "name": 3}], "messages[0].name"),
    ([{"role": "assistant", "tool_calls": {"f": 1}}], "messages[0].tool_calls"),
    ([{"role": "assistant", "tool_calls": [{"function": {"arguments": "{oops"}}]}],
     "messages[0].tool_calls[0].function.arguments"),
    ([{"role": "assistant", "tool_calls": [{"function": "f"}]}],
     "messages[0].tool_calls[0].function"),
])
def test_malformed_messages_are_refused_by_where(messages, param):
    body = {} if messages is None else {"messages": messages}
    assert refused(body).param == param


def test_images_only_as_data_urls_unless_allowed():
    def image(url):
        return {"messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "?"}]}]}

    check_request("chat", image("data:image/png;base64,AAAA"), VISION, LIMITS)
    for url in ("http://127.0.0.1:9/x.png", "https://example.com/x.png", "file:///etc/passwd"):
        assert "content[0]" in refused(image(url), served=VISION).param
    allowed = ServerLimits(allow_remote_images=True)
    check_request("chat", image("https://example.com/x.png"), VISION, allowed)
    assert refused(image("file:///etc/passwd"), served=VISION, limits=allowed)


@pytest.mark.parametrize("prompt", [None, "", 5, ["a", "b"], {"text": "a"}])
def test_text_prompts_are_non_empty_strings(prompt):
    body = {} if prompt is None else {"prompt": prompt}
    assert refused(body, kind="text").param == "prompt"


def test_other_models_are_refused_alike_whatever_exists():
    errors = [refused(chat(model=m)) for m in ("/etc", "/etc/passwd", "/no/such", "other")]
    assert {(e.status, e.param, e.code) for e in errors} == {(404, "model", "model_not_found")}
    # The answer names the request's value and the served model, nothing of the disk.
    assert all(str(e).split("'", 2)[2] == str(errors[0]).split("'", 2)[2] for e in errors)
    assert refused(chat(model=5)).param == "model"


def test_body_must_be_an_object():
    for body in ([], "x", 3):
        assert refused(body).status == 400


def test_errors_are_openai_shaped():
    error = RequestError("max_tokens must be ...", "max_tokens")
    assert error.as_json() == {"error": {"message": "max_tokens must be ...",
                                         "type": "invalid_request_error",
                                         "param": "max_tokens", "code": None}}
    assert RequestError("x", status=500).as_json()["error"]["type"] == "server_error"


@pytest.mark.parametrize("field, value", [
    ("max_body_bytes", 0), ("max_prompt_tokens", -1), ("max_tokens_limit", 1.5),
    ("header_timeout", 0), ("body_timeout", math.nan), ("max_body_bytes", True)])
def test_limits_refuse_nonsense(field, value):
    with pytest.raises(ValueError, match=field):
        ServerLimits(**{field: value})
