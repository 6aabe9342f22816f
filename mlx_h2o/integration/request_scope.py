"""One request as mlx_lm.server's handler serves it: its failures answered,
its client watched.

``RequestScope`` is the response generator as one request's handler sees
it: a failure before or during generation is answered as an OpenAI-style
JSON error (``as_request_error``: 4xx for the request's own, 5xx for the
server's), a client that closes its connection stops its generation at the
next token or prompt chunk, and a non-streamed answer is generated whole
before its headers are sent (so a failure still gets a status of its own).
"""

import logging
import select
import socket

from .request_checks import RequestError


class ClientLeft(Exception):
    """The client closed its connection before its answer was complete."""


class Answered(BaseException):
    """The request's answer is sent: unwinds mlx-lm's handler, whose
    ``except Exception`` would answer again."""


def client_left(sock: socket.socket) -> bool:
    """The peer closed (or reset) the connection: readable with nothing to read."""
    try:
        readable, _, _ = select.select([sock], [], [], 0)
        return bool(readable) and sock.recv(1, socket.MSG_PEEK) == b""
    except (OSError, ValueError):
        return True


def as_request_error(e: Exception) -> RequestError:
    """What a request's failure is answered with: a RequestError as it is, a
    stopped loop as 503, anything else as 500 (logged, not shown)."""
    if isinstance(e, RequestError):
        return e
    if isinstance(e, RuntimeError) and "generation thread died" in str(e):
        return RequestError("the generation loop has stopped; restart the server", None, 503,
                            "unavailable")
    logging.error("request failed", exc_info=e)
    return RequestError("generation failed for this request (the server logged why)", None,
                        500, "generation_failed")


class RequestScope:
    """The response generator as one request's handler sees it: failures are
    answered as errors, a client that leaves stops its generation, and a
    non-streamed answer is generated whole before its headers are sent."""

    def __init__(self, generator, handler):
        self._generator, self._handler = generator, handler

    def __getattr__(self, name):
        return getattr(self._generator, name)

    def generate(self, request, args, progress_callback=None):
        handler = self._handler

        def progress(done, total):  # each prompt chunk
            handler.check_client()
            if progress_callback is not None:
                progress_callback(done, total)

        try:
            ctx, responses = self._generator.generate(request, args, progress)
        except Exception as e:
            handler.refuse(as_request_error(e))
            raise Answered from e
        if handler.stream:
            return ctx, self._streamed(responses)
        try:
            return ctx, iter(list(self._checked(responses)))
        except ClientLeft:
            ctx.stop()
            handler.close_connection = True
            raise Answered from None
        except Exception as e:
            ctx.stop()
            handler.refuse(as_request_error(e))
            raise Answered from e

    def _checked(self, responses):
        for response in responses:
            yield response
            self._handler.check_client()

    def _streamed(self, responses):
        try:
            yield from self._checked(responses)
        except ClientLeft:
            raise
        except Exception as e:  # after the headers: an error event ends the stream
            self._handler.stream_error(as_request_error(e))
            raise Answered from e
