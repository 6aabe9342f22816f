"""mlx_lm.server's generation loop, kept alive and fed only checked prompts.

``GuardedResponseGenerator`` is ``mlx_lm.server.ResponseGenerator`` with:

- prompts tokenized in the HTTP handler's thread, not the generation loop's
  (those with images excepted): a prompt over ``--max-prompt-tokens`` (or of
  no tokens, or that the chat template refuses) is refused there, and a long
  one never stalls the batch;
- a loop that outlives a failure: the requests it was serving end with an
  error and the loop starts again (a failure that no new request brought
  ends it, as in mlx-lm, and ``/health`` answers 503);
- Python's cyclic garbage collected at most once every ``GC_INTERVAL``
  seconds while requests come and go: a released ``H2OKVCache`` is freed
  only by that collector (it and its decode step refer to each other), which
  counts objects, not bytes, and would let the K/V of many finished requests
  pile up between its own full passes.
"""

import gc
import logging
import time
import weakref
from dataclasses import dataclass
from typing import Optional

import mlx_lm.server as server

from .request_checks import IMAGE_PARTS, RequestError
from .served import ServedModel, ServerLimits


@dataclass
class TokenizedRequest(server.CompletionRequest):
    """A request with what ``_tokenize`` made of it (prompt, segments, segment
    types, initial state, images), made before it was queued."""

    tokenized: Optional[tuple] = None


GC_INTERVAL = 1.0  # seconds between collections while requests are served


def _has_images(messages) -> bool:
    return any(isinstance(part, dict) and part.get("type") in IMAGE_PARTS
               for m in messages if isinstance(m.get("content"), list) for part in m["content"])


class _OpenQueue:
    """A request's response queue: known to the generator until its end (None
    or an error) is put on it, or the loop drops it (a stopped request)."""

    def __init__(self, queue, open_queues: dict):
        self._queue, self._open = queue, open_queues
        open_queues[id(self)] = self

    def put(self, item, *args, **kwargs):
        if item is None or isinstance(item, Exception):
            self._open.pop(id(self), None)
        return self._queue.put(item, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._queue, name)


class GuardedResponseGenerator(server.ResponseGenerator):
    """``ResponseGenerator`` for a server that no request can break; ``served``
    and ``limits`` are what the HTTP handler checks requests against."""

    def __init__(self, model_provider, prompt_cache, served: ServedModel,
                 limits: ServerLimits):
        self.served, self.limits = served, limits
        # The requests taken off the queue and not yet ended (weak: the loop
        # drops a stopped request's queue without putting an end on it).
        self._open = weakref.WeakValueDictionary()
        self._taken = 0  # requests taken off the queue
        self._served_since_gc, self._collected_at = False, time.monotonic()
        super().__init__(model_provider, prompt_cache)

    def generate(self, request, generation_args, progress_callback=None):
        """``ResponseGenerator.generate`` after tokenizing the prompt here (the
        handler's thread): RequestError for a prompt the server refuses. A
        prompt with images is prepared by the loop, as mlx-lm does (its image
        arrays are made on the generation stream), and checked there."""
        if not self.generation_available():
            raise RuntimeError("generation thread died")
        tokenized, tokenizer = None, self.model_provider.tokenizer
        if not _has_images(request.messages):
            tokenized = self._checked_tokens(request, generation_args, tokenizer)
        request = TokenizedRequest(**vars(request), tokenized=tokenized)
        return super().generate(request, generation_args, progress_callback)

    def _checked_tokens(self, request, args, tokenizer) -> tuple:
        """mlx-lm's ``_tokenize``; RequestError for what the server refuses."""
        field = "messages" if request.request_type == "chat" else "prompt"
        try:
            tokenized = super()._tokenize(tokenizer, request, args)
        except Exception as e:  # the template or tokenizer refused the request's data
            logging.info("request refused at tokenization: %r", e)
            first = next((l for l in str(e).splitlines() if l.strip()), type(e).__name__)
            raise RequestError(f"{field} could not be tokenized: {first[:300]}", field) from e
        n, limit = len(tokenized[0]), self.limits.max_prompt_tokens
        if n == 0:
            raise RequestError(f"{field} gives no tokens", field)
        if n > limit:
            raise RequestError(f"{field}: the prompt is {n} tokens, this server takes at most "
                               f"{limit} (--max-prompt-tokens)", field, 400,
                               "context_length_exceeded")
        return tokenized

    def _tokenize(self, tokenizer, request, args):
        tokenized = getattr(request, "tokenized", None)
        if tokenized is None:
            return self._checked_tokens(request, args, tokenizer)
        prompt, segments, types, state, vision = tokenized  # fresh lists: the loop edits them
        return list(prompt), [list(s) for s in segments], list(types), state, vision

    def _next_request(self, timeout=None):
        self._collect_garbage()
        request = super()._next_request(timeout)
        if request is None:
            return None
        self._taken += 1
        self._served_since_gc = True
        return (_OpenQueue(request[0], self._open), *request[1:])

    def _collect_garbage(self):
        """Between the loop's steps: while requests are served and once after
        the last one ends, at most every GC_INTERVAL seconds."""
        if not self._served_since_gc or time.monotonic() - self._collected_at < GC_INTERVAL:
            return
        gc.collect()
        self._collected_at = time.monotonic()
        self._served_since_gc = len(self._open) > 0

    def _run_generate(self):
        taken_at_failure = None
        while True:
            try:
                self._generate()
                return
            except Exception as e:
                failed = list(self._open.values())
                for queue in failed:
                    self._open.pop(id(queue), None)
                logging.exception("generation failed (%s); %d request(s) end with an error",
                                  type(e).__name__, len(failed))
                for queue in failed:
                    queue.put(RequestError("generation failed for this request (the server "
                                           "logged why)", None, 500, "generation_failed"))
                if self._stop or self._taken == taken_at_failure:
                    self._generation_failed = True  # no request brought it: the loop is broken
                    return
                taken_at_failure = self._taken
