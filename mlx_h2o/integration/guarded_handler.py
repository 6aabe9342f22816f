"""mlx_lm.server's HTTP handler, made strict: every request is read within
limits and checked before mlx-lm's handler sees it.

``GuardedAPIHandler`` is ``mlx_lm.server.APIHandler`` (its response generator
a ``GuardedResponseGenerator``) with:

- headers and body read against deadlines (``--header-timeout``,
  ``--body-timeout``; the latter also bounds how long a client may leave its
  answer unread), a body of at most ``--max-body-bytes`` and a valid
  Content-Length, UTF-8 JSON of bounded depth;
- the body checked field by field (``request_checks``), then handed to
  mlx-lm's handler as checked;
- every refusal and failure answered with an OpenAI-style JSON error (4xx
  naming the field, 5xx for the server's own), other methods with 405;
- ``GET /v1/models`` answering with the model served, ``GET /health`` with
  the process's MLX memory too;
- a client that leaves stopping its generation (between tokens and prompt
  chunks, streamed or not).
"""

import io
import json
import logging
import socket
import time
from http import HTTPStatus
from http.server import ThreadingHTTPServer
from urllib.parse import unquote, urlsplit

import mlx.core as mx
import mlx_lm.server as server

from .request_checks import RequestError, check_request
from .request_scope import Answered, ClientLeft, RequestScope, client_left

COMPLETIONS = {"/v1/chat/completions": "chat", "/chat/completions": "chat",
               "/v1/completions": "text"}


class _DeadlineReader(io.RawIOBase):
    """A socket read against a deadline (``deadline``: time.monotonic())."""

    def __init__(self, sock: socket.socket, idle_timeout: float):
        self.sock, self.idle_timeout, self.deadline = sock, idle_timeout, None

    def readable(self):
        return True

    def readinto(self, buffer):
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("read deadline passed")
        self.sock.settimeout(left)
        try:
            return self.sock.recv_into(buffer)
        finally:
            self.sock.settimeout(self.idle_timeout)  # the send timeout between reads


class GuardedAPIHandler(server.APIHandler):
    """``APIHandler`` that reads, checks and answers every request within the
    response generator's ``limits`` and ``served`` model."""

    @property
    def limits(self):
        return self.response_generator.limits

    @property
    def served(self):
        return self.response_generator.served

    def setup(self):
        super().setup()
        self.rfile.close()
        self._reader = _DeadlineReader(self.connection, self.limits.body_timeout)
        self.connection.settimeout(self.limits.body_timeout)
        self.rfile = io.BufferedReader(self._reader)

    def handle_one_request(self):
        self._reader.deadline = time.monotonic() + self.limits.header_timeout
        super().handle_one_request()

    def do_POST(self):
        path = urlsplit(self.path).path
        try:
            if path not in COMPLETIONS:
                raise RequestError(f"no POST endpoint {path[:100]!r} (POST "
                                   f"{', '.join(COMPLETIONS)})", status=404, code="not_found")
            body = check_request(COMPLETIONS[path], self._read_json(), self.served,
                                 self.limits)
        except RequestError as e:
            return self.refuse(e)
        self._forward(path, body)

    def _read_json(self):
        if self.headers.get("Transfer-Encoding"):
            raise RequestError("send the body with a Content-Length, not a Transfer-Encoding",
                               status=411)
        length = self.headers.get("Content-Length")
        if length is None:
            raise RequestError("a Content-Length header is required", status=411)
        if not length.strip().isascii() or not length.strip().isdigit():
            raise RequestError(f"Content-Length must be a byte count, got {length[:20]!r}")
        size, limit = int(length), self.limits.max_body_bytes
        if size > limit:
            raise RequestError(f"the body is {size} bytes, this server takes at most {limit} "
                               "(--max-body-bytes)", status=413, code="body_too_large")
        self._reader.deadline = time.monotonic() + self.limits.body_timeout
        try:
            raw = self.rfile.read(size)
        except TimeoutError:
            raise RequestError(f"the body did not arrive within {self.limits.body_timeout:g} s "
                               "(--body-timeout)", status=408) from None
        if len(raw) < size:
            raise RequestError(f"the body ended after {len(raw)} of its {size} bytes")
        try:
            return json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError as e:
            raise RequestError(f"the body is not UTF-8 (byte {e.start})") from None
        except RecursionError:
            raise RequestError("the body's JSON nests too deeply") from None
        except ValueError as e:
            raise RequestError(f"the body is not valid JSON: {str(e)[:200]}") from None

    def _forward(self, path, body):
        """mlx-lm's handler, reading the checked body."""
        data = json.dumps(body).encode()
        del self.headers["Content-Length"]
        self.headers["Content-Length"] = str(len(data))
        rfile, self.rfile, self.path = self.rfile, io.BytesIO(data), path
        try:
            super().do_POST()
        finally:
            self.rfile = rfile

    def handle_completion(self, request, stop_words):
        generator = self.response_generator
        self.response_generator = RequestScope(generator, self)
        try:
            super().handle_completion(request, stop_words)
        except Answered:
            pass
        except (ClientLeft, ConnectionError) as e:
            self.close_connection = True
            logging.info("client left before its answer was complete (%s)", type(e).__name__)
        finally:
            self.response_generator = generator

    def check_client(self):
        if client_left(self.connection):
            raise ClientLeft("the client closed the connection")

    def do_GET(self):
        path = urlsplit(self.path).path
        if path == "/health":
            return self.handle_health_check()
        if path == "/v1/models":
            return self._send_json(200, {"object": "list", "data": [self._model_card()]})
        name = unquote(path[len("/v1/models/"):]) if path.startswith("/v1/models/") else None
        if name is not None and name in self.served.aliases:
            return self._send_json(200, self._model_card())
        if name is not None:
            return self.refuse(RequestError(f"model {name[:100]!r} is not served here; this "
                                            f"server serves {self.served.name!r}", "model",
                                            404, "model_not_found"))
        self.refuse(RequestError(f"no GET endpoint {path[:100]!r} (GET /v1/models, /health)",
                                 status=404, code="not_found"))

    def handle_health_check(self):
        """mlx-lm's ``{"status"}`` (503 once the generation loop has stopped) and
        the process's MLX memory in bytes: arrays held, MLX's buffer cache, peak
        (on a GPU, the device memory)."""
        healthy = self.response_generator.is_healthy
        memory = {"active": mx.get_active_memory(), "cache": mx.get_cache_memory(),
                  "peak": mx.get_peak_memory()}
        self._send_json(200 if healthy else 503,
                        {"status": "ok" if healthy else "unavailable", "mlx_memory": memory})

    def _model_card(self):
        return {"id": self.served.name, "object": "model", "created": self.served.created,
                "owned_by": "mlx-h2o"}

    def _not_allowed(self):
        self.refuse(RequestError(f"{self.command} is not supported; use GET or POST",
                                 status=405, code="method_not_allowed"),
                    {"Allow": "GET, POST, OPTIONS"})

    do_PUT = do_DELETE = do_PATCH = do_HEAD = do_TRACE = do_CONNECT = _not_allowed

    def send_error(self, code, message=None, explain=None):
        """The standard library's errors (bad request line, too many headers,
        unknown method, timeouts) as JSON."""
        self.refuse(RequestError(message or HTTPStatus(code).phrase, status=code))

    def refuse(self, error: RequestError, headers=None):
        logging.info("answered %d: %s", error.status, error)
        self.close_connection = True
        self._send_json(error.status, error.as_json(), headers)

    def stream_error(self, error: RequestError):
        try:
            self.wfile.write(f"data: {json.dumps(error.as_json())}\n\n".encode())
            self.wfile.flush()
        except OSError:
            pass

    def _send_json(self, status, payload, headers=None):
        data = json.dumps(payload).encode()
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            if hasattr(self, "headers"):  # a request line too bad to read has none
                self._set_cors_headers()
            for key, value in (headers or {}).items():
                self.send_header(key, value)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(data)
            self.wfile.flush()
        except OSError:  # the client is gone
            self.close_connection = True

    def generate_response(self, *args, **kwargs):
        return self._named(super().generate_response(*args, **kwargs))

    def completion_usage_response(self, *args, **kwargs):
        return self._named(super().completion_usage_response(*args, **kwargs))

    def _named(self, response: dict) -> dict:
        response["model"] = self.served.name
        return response


class GuardedHTTPServer(ThreadingHTTPServer):
    """A thread per connection, as mlx-lm's; a listen backlog of 128, not the
    standard library's 5, so a burst of clients is queued rather than reset."""

    request_queue_size = 128


def serve_http(host: str, port: int, generator, handler_class=GuardedAPIHandler) -> None:
    """``mlx_lm.server``'s HTTP server with ``handler_class`` (a GuardedAPIHandler)."""
    server._run_http_server(host, port, generator, server_class=GuardedHTTPServer,
                            handler_class=handler_class)
