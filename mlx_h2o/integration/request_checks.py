"""Every field of a completion request that mlx_lm.server reads, checked first.

``check_request(kind, body, served, limits)`` returns the body mlx-lm's
handler is given: each field it reads has the type and range its generation
code can take (ids inside the vocabulary, finite numbers, stop words as a
list of strings, ``stream_options`` with ``include_usage``), ``null`` means
the server's default, and ``model`` / ``draft_model`` name the model fixed at
start (as mlx-lm's ``default_model``). Anything else raises ``RequestError``:
the HTTP status and the field, for an OpenAI-style error answer.
"""

import json
import math
import re
from typing import Any, Dict

from .served import DEFAULT_MODEL_KEY, ServedModel, ServerLimits

MAX_STOP_WORDS = 16
TOP_LOGPROBS = 11  # mlx_lm.server's bound
IMAGE_PARTS = ("image_url", "input_image", "image")
# apply_chat_template's own parameters: a request's chat_template_kwargs may not
# set them (a custom template, no tokenization, another generation prompt).
TEMPLATE_PARAMS = frozenset((
    "conversation", "tools", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "sanitize_control_tokens", "padding",
    "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs"))
_TOKEN_ID = re.compile(r"[0-9]{1,12}")


class RequestError(ValueError):
    """A request refused: ``status`` (HTTP), ``param`` (the field), ``code``."""

    def __init__(self, message: str, param: str = None, status: int = 400, code: str = None):
        super().__init__(message)
        self.param, self.status, self.code = param, status, code

    def as_json(self) -> Dict[str, Any]:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return {"error": {"message": str(self), "type": kind, "param": self.param,
                          "code": self.code}}


def check_request(kind: str, body: Any, served: ServedModel, limits: ServerLimits) -> dict:
    """``kind``: "chat" or "text". The checked body, or RequestError."""
    if not isinstance(body, dict):
        raise RequestError(f"the request body must be a JSON object, got {_type(body)}")
    out = {k: v for k, v in body.items() if v is not None}  # null: the default
    _check_model(out, served)
    _check_sampling(out, served, limits)
    _check_output(out, limits)
    if kind == "chat":
        _check_messages(out, served, limits)
    else:
        _check_prompt(out)
    return out


def _type(value) -> str:
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean",
            int: "an integer", float: "a number"}.get(type(value), type(value).__name__)


def _number(body, name, lo=None, hi=None, integer=False, note=""):
    if name not in body:
        return
    value = body[name]
    if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)):
        raise RequestError(f"{name} must be {'an integer' if integer else 'a number'}, got "
                           f"{_type(value)}", name)
    if not integer and not math.isfinite(value):
        raise RequestError(f"{name} must be a finite number", name)
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        span = (f"from {lo} to {hi}" if lo is not None and hi is not None
                else f"at least {lo}" if lo is not None else f"at most {hi}")
        raise RequestError(f"{name} must be {span}{note}, got {value}", name)


def _boolean(body, name):
    if name in body and not isinstance(body[name], bool):
        raise RequestError(f"{name} must be true or false, got {_type(body[name])}", name)


def _object(value, name):
    if not isinstance(value, dict):
        raise RequestError(f"{name} must be an object, got {_type(value)}", name)


def _check_model(body, served):
    model = body.get("model", DEFAULT_MODEL_KEY)
    if not isinstance(model, str) or model not in served.aliases:
        shown = model[:100] if isinstance(model, str) else _type(model)
        raise RequestError(f"model {shown!r} is not served here; this server serves "
                           f"{served.name!r} (leave model out or give that name)", "model",
                           404, "model_not_found")
    draft = body.get("draft_model", DEFAULT_MODEL_KEY)
    if draft not in (DEFAULT_MODEL_KEY, served.draft):
        fixed = f"{served.draft!r}" if served.draft else "none"
        raise RequestError(f"draft_model is fixed when the server starts (here: {fixed}); "
                           "leave draft_model out", "draft_model")
    if "adapters" in body:
        raise RequestError("adapters are fixed when the server starts (--adapter-path); "
                           "leave adapters out", "adapters")
    body["model"], body["draft_model"] = DEFAULT_MODEL_KEY, DEFAULT_MODEL_KEY


def _check_sampling(body, served, limits):
    last_id = served.vocab_size - 1
    _number(body, "temperature", lo=0)
    for name in ("top_p", "min_p", "xtc_probability"):
        _number(body, name, lo=0, hi=1)
    _number(body, "xtc_threshold", lo=0, hi=0.5)
    _number(body, "top_k", lo=0, hi=last_id, integer=True, note=" (0: off)")
    _number(body, "repetition_penalty", lo=0)
    for name in ("presence_penalty", "frequency_penalty"):
        _number(body, name)
    for name in ("repetition_context_size", "presence_context_size", "frequency_context_size"):
        _number(body, name, lo=0, hi=limits.max_sequence, integer=True)
    _number(body, "num_draft_tokens", lo=0, hi=limits.max_tokens_limit, integer=True)
    _number(body, "seed", lo=0, hi=2**64 - 1, integer=True)
    for name in ("xtc_probability", "xtc_threshold"):  # mlx-lm takes floats only
        if name in body:
            body[name] = float(body[name])
    if "logit_bias" in body:
        body["logit_bias"] = _logit_bias(body["logit_bias"], last_id)
    if "chat_template_kwargs" in body:
        kwargs = body["chat_template_kwargs"]
        _object(kwargs, "chat_template_kwargs")
        taken = sorted(TEMPLATE_PARAMS.intersection(kwargs))
        if taken:
            raise RequestError(f"chat_template_kwargs may not set {', '.join(taken)} (the "
                               "server sets them)", "chat_template_kwargs")


def _logit_bias(bias, last_id) -> Dict[str, float]:
    _object(bias, "logit_bias")
    out = {}
    for key, value in bias.items():
        if not _TOKEN_ID.fullmatch(key) or int(key) > last_id:
            raise RequestError(f"logit_bias keys must be token ids from 0 to {last_id}, got "
                               f"{key[:20]!r}", "logit_bias")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(
                value):
            raise RequestError(f"logit_bias values must be finite numbers (token {key})",
                               "logit_bias")
        out[str(int(key))] = float(value)
    return out


def _check_output(body, limits):
    limit = limits.max_tokens_limit
    for name in ("max_tokens", "max_completion_tokens"):
        _number(body, name, lo=1, hi=limit, integer=True,
                note=" (this server's --max-tokens-limit)")
    for name in ("stream", "logprobs"):
        _boolean(body, name)
    _number(body, "top_logprobs", lo=-1, hi=TOP_LOGPROBS, integer=True)
    if body.get("stream") and "stream_options" in body:
        options = body["stream_options"]
        _object(options, "stream_options")
        if not isinstance(options.get("include_usage", False), bool):
            raise RequestError("stream_options.include_usage must be true or false",
                               "stream_options.include_usage")
        body["stream_options"] = {"include_usage": options.get("include_usage", False)}
    else:
        body.pop("stream_options", None)
    if "stop" in body:
        stop = [body["stop"]] if isinstance(body["stop"], str) else body["stop"]
        if (not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop)
                or len(stop) > MAX_STOP_WORDS):
            raise RequestError(f"stop must be a non-empty string or a list of at most "
                               f"{MAX_STOP_WORDS} of them", "stop")
        body["stop"] = stop


def _check_prompt(body):
    prompt = body.get("prompt")
    if not isinstance(prompt, str) or not prompt:
        raise RequestError("prompt must be a non-empty string"
                           + ("" if prompt is None else f", got {_type(prompt)}"), "prompt")


def _check_messages(body, served, limits):
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty array of {role, content} objects",
                           "messages")
    for i, message in enumerate(messages):
        _check_message(message, f"messages[{i}]", served, limits)
    if "tools" in body and not (isinstance(body["tools"], list)
                                and all(isinstance(t, dict) for t in body["tools"])):
        raise RequestError("tools must be an array of objects", "tools")
    mapping = body.get("role_mapping", {})
    if not (isinstance(mapping, dict) and all(isinstance(v, str) for v in mapping.values())):
        raise RequestError("role_mapping must be an object of strings", "role_mapping")


def _check_message(message, where, served, limits):
    _object(message, where)
    if not isinstance(message.get("role"), str) or not message["role"]:
        raise RequestError(f"{where}.role must be a non-empty string", f"{where}.role")
    for key in ("name", "tool_call_id"):
        if message.get(key) is not None and not isinstance(message[key], str):
            raise RequestError(f"{where}.{key} must be a string", f"{where}.{key}")
    content = message.get("content")
    if isinstance(content, list):
        for j, part in enumerate(content):
            _check_part(part, f"{where}.content[{j}]", served, limits)
    elif content is not None and not isinstance(content, str):
        raise RequestError(f"{where}.content must be a string or an array of content parts, "
                           f"got {_type(content)}", f"{where}.content")
    calls = message.get("tool_calls")
    if calls is not None:
        if not isinstance(calls, list):
            raise RequestError(f"{where}.tool_calls must be an array", f"{where}.tool_calls")
        for j, call in enumerate(calls):
            _check_tool_call(call, f"{where}.tool_calls[{j}]")


def _check_part(part, where, served, limits):
    _object(part, where)
    kind = part.get("type")
    if kind == "text":
        if not isinstance(part.get("text"), str):
            raise RequestError(f"{where}.text must be a string", f"{where}.text")
        return
    if kind not in IMAGE_PARTS:
        raise RequestError(f"{where}.type must be text or image_url, got {str(kind)[:40]!r}",
                           f"{where}.type")
    if not served.vision:
        raise RequestError(f"{where}: this model reads text only", f"{where}.type")
    url = part.get("image_url", part.get("image"))
    url = url.get("url") if isinstance(url, dict) else url
    if not isinstance(url, str):
        raise RequestError(f"{where} needs an image URL string", where)
    if url.startswith(("http://", "https://")) and not limits.allow_remote_images:
        raise RequestError(f"{where}: remote images are not fetched by this server (send a "
                           "data: URL; --allow-remote-images lets it fetch)", where)
    if not url.startswith(("data:", "http://", "https://")):
        raise RequestError(f"{where}: images must be data: URLs", where)


def _check_tool_call(call, where):
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict):
        raise RequestError(f"{where}.function must be an object", f"{where}.function")
    arguments = function.get("arguments")
    if isinstance(arguments, str) and arguments:
        try:
            json.loads(arguments)
        except (ValueError, RecursionError):
            raise RequestError(f"{where}.function.arguments must be JSON text",
                               f"{where}.function.arguments") from None
    elif arguments is not None and not isinstance(arguments, (str, dict)):
        raise RequestError(f"{where}.function.arguments must be JSON text or an object",
                           f"{where}.function.arguments")
