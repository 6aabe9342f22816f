"""The cases of benchmarks/hostile_clients.py: hostile and malformed clients of an
OpenAI-compatible server on 127.0.0.1, as raw bytes over a socket.

Each ``Case`` names what mlx-h2o serve must answer (its HTTP status, the
field its error names); ``run(ctx)`` sends it and returns an ``Outcome`` (the
status or what happened instead, the seconds to it). ``normal(ctx)`` is the
request whose answer must not change from case to case. tests/test_server_hostile.py
sends the same cases to a real mlx-h2o serve.
"""

import json
import socket
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_load import HOST  # noqa: E402

CHAT = "/v1/chat/completions"
LONG_ANSWER = 200  # tokens the clients that leave ask for


@dataclass
class Outcome:
    status: Optional[int]  # None: no HTTP answer
    seconds: float
    body: bytes = b""
    note: str = ""

    def error(self):
        try:
            return json.loads(self.body).get("error")
        except (ValueError, AttributeError):
            return None

    def describe(self):
        """The status and the field named (mlx-h2o) or the message's start (stock)."""
        if self.status is None:
            return self.note
        error = self.error()
        said = error.get("param") if isinstance(error, dict) else (
            f'"{error[:48]}"' if isinstance(error, str) else None)
        return f"{self.status}" + (f" {said}" if said else "") + (
            f" ({self.note})" if self.note else "")


@dataclass
class Case:
    name: str
    expect: Optional[int]  # mlx-h2o serve's status (None: the connection closes)
    run: Callable  # (Context) -> Outcome
    param: Optional[str] = None  # the field mlx-h2o's error names


@dataclass
class Context:
    port: int
    model: str  # the served model's name
    eos: list  # end-of-sequence ids, banned where an answer must be long
    max_prompt_tokens: int
    wait: float  # seconds a case waits for an answer
    listener: "Listener" = None
    long_answer: int = LONG_ANSWER  # tokens the clients that leave ask for


class Listener(threading.Thread):
    """A TCP listener on 127.0.0.1 that counts the connections it gets."""

    def __init__(self):
        super().__init__(daemon=True)
        self.sock = socket.create_server((HOST, 0))
        self.port, self.hits = self.sock.getsockname()[1], 0

    def run(self):
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.hits += 1
            conn.sendall(b"HTTP/1.0 404 Not Found\r\nContent-Length: 0\r\n\r\n")
            conn.close()


# --- raw HTTP ------------------------------------------------------------------------------------
def http(method, path, body=b"", headers=None, length=None):
    """Request bytes; ``length``: the Content-Length to claim (None: the body's)."""
    lines = [f"{method} {path} HTTP/1.1", f"Host: {HOST}", "Content-Type: application/json"]
    if length != "omit":
        lines.append(f"Content-Length: {len(body) if length is None else length}")
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


def exchange(ctx, data, wait=None, leave_after=None):
    """Send ``data``, read the answer until the server closes (or ``wait``
    seconds pass); ``leave_after``: close after that many seconds or at the
    first streamed data line, whichever comes first."""
    wait = ctx.wait if wait is None else wait
    start = time.monotonic()
    received = b""
    with socket.create_connection((HOST, ctx.port), timeout=wait) as sock:
        try:
            sock.sendall(data)
            while time.monotonic() - start < wait:
                sock.settimeout(max(0.05, min(leave_after or wait, wait)
                                    - (time.monotonic() - start)))
                chunk = sock.recv(65536)
                if not chunk:
                    break
                received += chunk
                if leave_after is not None and b"\ndata:" in received:
                    return Outcome(None, time.monotonic() - start, received, "left")
            else:
                return Outcome(None, wait, received, f"no answer in {wait:g} s")
        except socket.timeout:
            if leave_after is not None:
                return Outcome(None, time.monotonic() - start, received, "left")
            return Outcome(None, wait, received, f"no answer in {wait:g} s")
        except (ConnectionResetError, BrokenPipeError):
            pass
    return parse(received, time.monotonic() - start)


def parse(received, seconds):
    head, _, body = received.partition(b"\r\n\r\n")
    parts = head.split(b" ", 2)
    if len(parts) < 2 or not parts[1].isdigit():
        return Outcome(None, seconds, received, "closed without an answer")
    status = int(parts[1])
    note = ""
    if b"text/event-stream" in head:
        note = "stream ends with [DONE]" if b"data: [DONE]" in body else "stream without [DONE]"
    elif status == 200 and b"application/json" not in head.lower():
        note = "not JSON"
    return Outcome(status, seconds, body, note)


def post(path, body, **kw):
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    return lambda ctx: exchange(ctx, http("POST", path, raw, **kw))


def chat(**extra):
    return {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4, **extra}


def ask(**extra):
    return post(CHAT, chat(**extra))


def text(prompt, **extra):
    return post("/v1/completions", {"prompt": prompt, "max_tokens": 4, **extra})


def method(verb, path=CHAT):
    return lambda ctx: exchange(ctx, http(verb, path, b""))


# --- cases needing the context -------------------------------------------------------------------
def remote_image(ctx):
    url = f"http://{HOST}:{ctx.listener.port}/cat.png"
    before = ctx.listener.hits
    out = post(CHAT, {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": url}},
        {"type": "text", "text": "What is this?"}]}], "max_tokens": 4})(ctx)
    time.sleep(0.2)
    out.note = "the server fetched the URL" if ctx.listener.hits > before else "not fetched"
    return out


def long_prompt(ctx):
    return text("word " * (2 * ctx.max_prompt_tokens))(ctx)


def lying_length(ctx):
    return exchange(ctx, http("POST", CHAT, b'{"messages": ', length=1000))


def endless_headers(ctx):
    return exchange(ctx, f"POST {CHAT} HTTP/1.1\r\nHost: {HOST}\r\n".encode())


def huge_body(ctx):  # claims 20 MB, sends 64 KB of it
    return exchange(ctx, http("POST", CHAT, b"[" * 65536, length=20_000_000))


def models(ctx):
    out = exchange(ctx, http("GET", "/v1/models"))
    try:
        ids = [m["id"] for m in json.loads(out.body)["data"]]
    except (ValueError, KeyError, TypeError):
        ids = None
    out.note = f"lists {ids}" if ids else "no model listed"
    return out


def leaves(stream):
    """A client that asks for a long answer and leaves after its first token
    (streamed) or one second; then a request served alone (a seed) times how
    long the server kept generating for the client that left."""

    def run(ctx):
        body = chat(max_tokens=ctx.long_answer, stream=stream,
                    logit_bias={str(i): -1e4 for i in ctx.eos})
        exchange(ctx, http("POST", CHAT, json.dumps(body).encode()), leave_after=1.0)
        out = exchange(ctx, http("POST", CHAT, json.dumps(chat(seed=1)).encode()),
                       wait=NORMAL_WAIT)
        out.note = f"the next request answered after {out.seconds:.1f} s"
        return out

    return run


CASES = [
    # request fields: types and ranges
    Case("logit_bias id past the vocabulary", 400, ask(logit_bias={"99999999": 100}),
         "logit_bias"),
    Case("logit_bias negative id", 400, ask(logit_bias={"-1": 100}), "logit_bias"),
    Case("logit_bias NaN value", 400, ask(logit_bias={"1": float("nan")}), "logit_bias"),
    Case("stop 123", 400, ask(stop=123), "stop"),
    Case("stop [1, 2]", 400, ask(stop=[1, 2]), "stop"),
    Case("stop [null]", 400, ask(stop=[None]), "stop"),
    Case("stop empty string", 400, ask(stop=""), "stop"),
    Case("temperature NaN", 400, ask(temperature=float("nan")), "temperature"),
    Case("temperature -1", 400, ask(temperature=-1), "temperature"),
    Case("temperature a string", 400, ask(temperature="hot"), "temperature"),
    Case("top_p 2", 400, ask(top_p=2), "top_p"),
    Case("top_k past the vocabulary", 400, ask(top_k=10**6, temperature=0.5), "top_k"),
    Case("xtc_threshold 0.9", 400, ask(xtc_probability=0.5, xtc_threshold=0.9, temperature=0.5),
         "xtc_threshold"),
    Case("max_tokens 10^9", 400, ask(max_tokens=10**9), "max_tokens"),
    Case("max_tokens 0", 400, ask(max_tokens=0), "max_tokens"),
    Case("seed -1", 400, ask(seed=-1), "seed"),
    Case("repetition_context_size 10^12", 400,
         ask(repetition_penalty=1.1, repetition_context_size=10**12), "repetition_context_size"),
    Case("messages []", 400, post(CHAT, {"messages": []}), "messages"),
    Case("messages a string", 400, post(CHAT, {"messages": "hi"}), "messages"),
    Case("message without role", 400, post(CHAT, {"messages": [{"content": "hi"}]}),
         "messages[0].role"),
    Case("content an integer", 400, post(CHAT, {"messages": [{"role": "user", "content": 5}]}),
         "messages[0].content"),
    Case("content part of type audio", 400, post(CHAT, {"messages": [{"role": "user", "content": [
        {"type": "audio", "audio": "x"}]}]}), "messages[0].content[0].type"),
    Case("tool call arguments not JSON", 400, post(CHAT, {"messages": [
        {"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]}),
         "messages[1].tool_calls[0].function.arguments"),
    Case("remote image_url", 400, remote_image, "messages[0].content[0].type"),
    Case("prompt empty", 400, text(""), "prompt"),
    Case("prompt an integer", 400, text(5), "prompt"),
    Case("prompt over --max-prompt-tokens", 400, long_prompt, "prompt"),
    Case("stream_options {}", 200, ask(stream=True, stream_options={})),
    Case('stream_options "x"', 400, ask(stream=True, stream_options="x"), "stream_options"),
    Case("model /etc/passwd", 404, ask(model="/etc/passwd"), "model"),
    Case("model /etc", 404, ask(model="/etc"), "model"),
    Case("draft_model /etc", 400, ask(draft_model="/etc"), "draft_model"),
    Case("adapters /tmp", 400, ask(adapters="/tmp"), "adapters"),
    Case("chat_template_kwargs tokenize false", 400,
         ask(chat_template_kwargs={"tokenize": False}), "chat_template_kwargs"),
    # transport
    Case("body not UTF-8", 400, post(CHAT, b'{"messages": "\xff\xfe"}')),
    Case("JSON nested 200,000 deep", 400, post(CHAT, b"[" * 200_000 + b"]" * 200_000)),
    Case("body not JSON", 400, post(CHAT, b"hello")),
    Case("body a JSON array", 400, post(CHAT, b"[]")),
    Case("Content-Length -1", 400, post(CHAT, json.dumps(chat()).encode(), length=-1)),
    Case("Content-Length past the body", 408, lying_length),
    Case("no Content-Length", 411, post(CHAT, json.dumps(chat()).encode(), length="omit")),
    Case("Content-Length of 20 MB", 413, huge_body),
    Case("headers never end", None, endless_headers),
    Case("PUT", 405, method("PUT")),
    Case("DELETE", 405, method("DELETE")),
    Case("method FOO", 501, method("FOO")),
    Case("GET /nope", 404, method("GET", "/nope")),
    Case("POST /nope", 404, post("/nope", chat())),
    Case("GET /v1/models", 200, models),
    # clients that leave
    Case("client leaves a non-streamed answer", 200, leaves(stream=False)),
    Case("client leaves mid-stream", 200, leaves(stream=True)),
]


NORMAL_WAIT = 300  # seconds the normal request may take (stock loads the model on its first)


def normal(ctx):
    """The normal request after each case: (answer or None, seconds)."""
    data = http("POST", CHAT, json.dumps(chat(max_tokens=8, temperature=0.0)).encode())
    try:
        out = exchange(ctx, data, wait=NORMAL_WAIT)
    except OSError:  # the server is gone
        return None, 0.0
    try:
        return json.loads(out.body)["choices"][0]["message"]["content"], out.seconds
    except (ValueError, KeyError, TypeError, IndexError):
        return None, out.seconds


def as_expected(case, out):
    """mlx-h2o serve's answer to ``case`` is the one it should give."""
    if out.status != case.expect:
        return False
    error = out.error()
    if case.param is not None and not (isinstance(error, dict) and error.get("param") ==
                                       case.param):
        return False
    return case.expect is None or case.expect >= 400 or out.note in (
        "", "stream ends with [DONE]") or out.note.startswith(("lists", "the next"))

