"""mlx-lm's OpenAI-compatible server with H2O caches and per-request cache stats.

``h2o_server(config)`` wraps ``use_h2o_caches`` (every cache the server builds
is an H2O one; batches are BatchH2OKVCache) and hooks the server's classes
for the stats: each finished request's cache (the one its prompt cache keeps)
is summarised as ``usage["h2o"]`` of its response and in a log line. ``run``
is ``mlx_lm.server.run`` with those classes, over the guarded generator and
handler (every request checked and bounded first). Under ``mlx.launch`` every rank
runs the generation loop (rank 0 the HTTP server too): the stats are summed
over the ranks (a collective at the same point of every rank's loop).
"""

import gc
import logging
import threading
from contextlib import contextmanager
from typing import Any, Dict, List, Optional

import mlx.core as mx
import mlx_lm.server as server
from mlx_lm.generate import BatchGenerator

from ..config import H2OConfig
from ..profiles import PACKAGED_ATTR
from .guarded_generator import GuardedResponseGenerator
from .guarded_handler import GuardedAPIHandler, serve_http
from .preview import MLX_LM_PREFILL_STEP, preview_prompt
from .served import ServedModel, ServerLimits
from .serving import use_h2o_caches
from .stats import cache_stats

_handler = threading.local()  # the context of the request this HTTP thread serves


def request_stats(cache: List[Any], batch_rows: int = 0, group=None,
                  split: str = "heads") -> Dict[str, Any]:
    """What a request's H2O cache holds (``CacheStats.usage``): tokens a layer,
    KV bytes against mlx-lm's KVCache.
    ``batch_rows``: the most requests decoded with it in one batch
    (BatchH2OKVCache; 0: served alone). ``group``: every rank's caches
    (``cache_stats``; a collective)."""
    return _as_usage(cache_stats(cache, group, split), batch_rows)


def _as_usage(s, batch_rows: int) -> Dict[str, Any]:
    return {"batched": batch_rows > 0, "batch_rows": batch_rows, **s.usage()}


class StatsTracker:
    """Carries each request's cache stats from the generation thread to its
    HTTP handler: the request context (``GenerationContext``) the server
    hands out last is the one its next ``insert`` / ``stream_generate`` serves."""

    def __init__(self, group: Optional[mx.distributed.Group] = None, split: str = "heads"):
        self.current = None
        self._contexts, self._rows = {}, {}
        self.group, self.split = group, split  # ranks of mlx.launch, what they split

    def bind(self, uids) -> None:
        for uid in uids:
            self._contexts[uid] = self.current

    def decoding(self, uids) -> None:
        """``uids`` decode together (one BatchGenerator step)."""
        for uid in uids:
            self._rows[uid] = max(self._rows.get(uid, 0), len(uids))

    def finished(self, uid, cache) -> None:
        self.record(self._contexts.pop(uid, None), cache, self._rows.pop(uid, 1))

    def dropped(self, uids) -> None:
        for uid in uids:
            self._contexts.pop(uid, None)
            self._rows.pop(uid, None)

    def record(self, ctx, cache, batch_rows: int = 0, log: bool = True) -> None:
        if not cache or not any(hasattr(c, "h2o_attention") for c in cache):
            return
        stats = cache_stats(cache, self.group, self.split)  # a collective under mlx.launch
        if ctx is not None:
            ctx.h2o_stats = _as_usage(stats, batch_rows)
        if log and (self.group is None or self.group.rank() == 0):
            logging.info("H2O cache of a finished request: %s", stats.summary())


class _TrackedQueue:
    """A request's response queue as the generation thread sees it."""

    def __init__(self, queue, tracker: StatsTracker):
        self._queue, self._tracker = queue, tracker

    def put(self, item, *args, **kwargs):
        if isinstance(item, server.GenerationContext):
            self._tracker.current = item
        return self._queue.put(item, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._queue, name)


def _batch_generator(tracker: StatsTracker):
    class H2OBatchGenerator(BatchGenerator):
        def insert_segments(self, *args, **kwargs):
            uids = super().insert_segments(*args, **kwargs)
            tracker.bind(uids)
            # Each new prompt's end, seen ahead by its own caches (merged
            # into the batch's rows with them): integration/preview.py.
            for _, segments, _, cache, *_ in list(self._unprocessed_sequences)[-len(uids):]:
                preview_prompt(self.model, cache, [t for s in segments for t in s],
                               self.prefill_step_size)
            return uids

        def _next(self):
            tracker.decoding(self._generation_batch.uids)
            prompt_responses, responses = super()._next()
            for r in responses:
                if r.finish_reason is not None and r.prompt_cache is not None:
                    tracker.finished(r.uid, r.prompt_cache)
            return prompt_responses, responses

        def remove(self, uids, return_prompt_caches=False):
            tracker.dropped(uids)
            return super().remove(uids, return_prompt_caches)

    return H2OBatchGenerator


def _stream_generate(tracker: StatsTracker, stream_generate):
    """The server's one-at-a-time path (seeded requests, a draft model)."""

    def tracked(*args, **kwargs):
        ctx, cache = tracker.current, kwargs.get("prompt_cache")
        model = kwargs.get("model")
        if cache is not None and model is not None and kwargs.get("input_embeddings") is None:
            preview_prompt(model, cache[: len(model.layers)], kwargs["prompt"],
                           kwargs.get("prefill_step_size", MLX_LM_PREFILL_STEP))
        try:
            for response in stream_generate(*args, **kwargs):
                tracker.record(ctx, cache, log=False)  # cheap: sizes, no device work
                yield response
        finally:
            tracker.record(ctx, cache)

    return tracked


class H2OResponseGenerator(GuardedResponseGenerator):
    def __init__(self, model_provider, prompt_cache, tracker: StatsTracker,
                 served: ServedModel, limits: ServerLimits):
        self.tracker = tracker  # before the generation thread starts
        super().__init__(model_provider, prompt_cache, served, limits)

    def _next_request(self, timeout=None):
        request = super()._next_request(timeout)
        if request is None:
            return None
        return (_TrackedQueue(request[0], self.tracker), *request[1:])

    def generate(self, request, generation_args, progress_callback=None):
        ctx, responses = super().generate(request, generation_args, progress_callback)
        _handler.ctx = ctx
        return ctx, responses


class H2OAPIHandler(GuardedAPIHandler):
    """``usage["h2o"]``: the request's cache stats (non-streamed responses,
    and streamed ones with ``stream_options.include_usage``)."""

    def generate_response(self, *args, **kwargs):
        return _with_stats(super().generate_response(*args, **kwargs))

    def completion_usage_response(self, *args, **kwargs):
        return _with_stats(super().completion_usage_response(*args, **kwargs))


def _with_stats(response: dict) -> dict:
    stats = getattr(getattr(_handler, "ctx", None), "h2o_stats", None)
    if stats is not None and "usage" in response:
        response["usage"]["h2o"] = dict(stats)
    return response


class H2OModelProvider(server.ModelProvider):
    """The server's model loader; a packaged model (``packaged``: its name and
    prepared path) gets its name recorded as ``load_model`` does, so
    ``layer_budget="auto"`` uses its shipped layer profile."""

    def __init__(self, cli_args, packaged: Optional[tuple] = None):
        self.packaged = packaged
        super().__init__(cli_args)

    def _load(self, model_path, adapter_path=None, draft_model_path=None):
        super()._load(model_path, adapter_path, draft_model_path)
        if self.packaged and model_path == self.packaged[1] and adapter_path is None:
            setattr(self.model, PACKAGED_ATTR, self.packaged[0])


@contextmanager
def h2o_server(config: H2OConfig, layer_budget="uniform", group=None, split: str = "heads"):
    """H2O caches everywhere in ``mlx_lm.server`` (and routing on) while open;
    yields the StatsTracker that ``run`` takes. ``group`` (under ``mlx.launch``)
    and ``split`` ("heads": tensor parallel, "layers": pipeline) go to the stats."""
    tracker = StatsTracker(group if group is not None and group.size() > 1 else None, split)
    names = ("BatchGenerator", "stream_generate")
    saved = {name: getattr(server, name) for name in names}
    with use_h2o_caches(config, layer_budget):
        server.BatchGenerator = _batch_generator(tracker)
        server.stream_generate = _stream_generate(tracker, saved["stream_generate"])
        try:
            yield tracker
        finally:
            for name, value in saved.items():
                setattr(server, name, value)


def run(host: str, port: int, model_provider, served: ServedModel, limits: ServerLimits,
        tracker: Optional[StatsTracker] = None) -> None:
    """``mlx_lm.server.run`` with the guarded response generator and handler
    (with a ``tracker``: the H2O ones, that report cache stats): under
    ``mlx.launch`` rank 0 serves HTTP, every rank generates."""
    # What is loaded now (the model, the code) lives as long as the server: frozen
    # out of the collector's passes, the generator's collections cost milliseconds.
    gc.collect()
    gc.freeze()
    prompt_cache = server.LRUPromptCache(model_provider.cli_args.prompt_cache_size)
    if tracker is None:
        generator = GuardedResponseGenerator(model_provider, prompt_cache, served, limits)
        handler = GuardedAPIHandler
    else:
        generator = H2OResponseGenerator(model_provider, prompt_cache, tracker, served, limits)
        handler = H2OAPIHandler
    if mx.distributed.init().rank() == 0:
        serve_http(host, port, generator, handler)
    else:
        generator.join()
