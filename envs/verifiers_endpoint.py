"""A vLLM-style ``/inference/v1/generate`` endpoint on loopback, answered by mixrl's episode driver.

``verifiers``' training client (``verifiers.v1.clients.train.TrainClient``, through
``renderers.client.generate`` of ``renderers`` 0.1.12) renders each chat turn to token ids itself
and sends ``POST <base>/inference/v1/generate`` with ``{"model", "token_ids", "sampling_params":
{..., "stop_token_ids", "logprobs": 1, "skip_special_tokens": false}}``; it reads back
``choices[0].token_ids``, ``choices[0].finish_reason`` and ``choices[0].logprobs.content[t]``
(``{"token": "token_id:<id>", "logprob": <finite, not vLLM's -9999 sentinel>}``, one per token,
checked), and once per (base URL, model) ``GET /v1/models`` for ``max_model_len`` (the pre-flight
length check). That is the answer vLLM 0.32 gives (``sampler_torch/backends/vllm_wire.py`` parses
the same shape).

Here each request is one policy turn of a mixrl episode: the HTTP thread hands it to the episode
(``Call``, by the request's ``model``, which names the episode) and waits; the sampler's own engine
generates the turn through mixrl's episode driver (``envs.rollout``), which keeps the tokens'
behaviour log-probs, kept sets and weight versions as the trajectory; the episode answers the call
with exactly those token ids and log-probs. Only ``stop_token_ids`` of the request is used (the
episode's stop tokens); temperature, top-p and the rest are the run's (``tasks.sampling``: the
trainer's objective assumes them), and ``max_tokens`` is bounded by the run's budget. Every call is
kept (``Call``: prompt ids, completion ids, log-probs, finish reason) for the episode's record.
"""

from __future__ import annotations

import json
import logging
import queue
import sys
import threading
import uuid
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

log = logging.getLogger("mixrl.envs")
_MAX_BODY = 256 * 1024**2


@dataclass(eq=False)
class Call:
    """One ``/inference/v1/generate`` request, waiting for its turn's answer."""

    model: str
    prompt_ids: list[int]
    stop_token_ids: list[int]
    max_tokens: int | None
    request_id: str = field(default_factory=lambda: f"mixrl-{uuid.uuid4().hex[:16]}")
    completion_ids: list[int] | None = None
    logprobs: list[float] | None = None
    finish_reason: str | None = None
    status: int = 0
    error: str = ""
    _done: threading.Event = field(default_factory=threading.Event, repr=False)

    def answer(self, completion_ids: list[int], logprobs: list[float], finish_reason: str) -> None:
        """Answer with the turn the engine generated (its exact ids and behaviour log-probs)."""
        if len(logprobs) != len(completion_ids):
            raise ValueError(f"{len(completion_ids)} token ids but {len(logprobs)} log-probs")
        self.completion_ids, self.logprobs = list(completion_ids), [float(x) for x in logprobs]
        self.finish_reason, self.status = finish_reason, 200
        self._done.set()

    def fail(self, status: int, error: str) -> None:
        """Answer with an HTTP error (the episode ended or refused the request)."""
        if not self._done.is_set():
            self.status, self.error = status, error
            self._done.set()

    def wait(self, timeout: float | None = None) -> bool:
        return self._done.wait(timeout)

    def body(self) -> dict[str, Any]:
        """The vLLM answer (see the module doc)."""
        content = [{"token": f"token_id:{t}", "logprob": lp}
                   for t, lp in zip(self.completion_ids or [], self.logprobs or [], strict=True)]
        return {"request_id": self.request_id, "prompt_token_ids": self.prompt_ids,
                "choices": [{"index": 0, "token_ids": self.completion_ids,
                             "finish_reason": self.finish_reason, "logprobs": {"content": content}}]}


class BadRequest(ValueError):
    """A request this endpoint cannot serve (HTTP 400, one line)."""


def parse_request(body: bytes, vocab_size: int) -> Call:
    """The ``Call`` of a generate request body; ``BadRequest`` naming what is wrong."""
    try:
        data = json.loads(body)
    except ValueError as e:
        raise BadRequest(f"body is not JSON ({e})") from None
    if not isinstance(data, dict):
        raise BadRequest("body is not a JSON object")
    model, ids = data.get("model"), data.get("token_ids")
    if not isinstance(model, str) or not model:
        raise BadRequest("'model' must be a non-empty string")
    if not isinstance(ids, list) or not ids or not all(type(t) is int and 0 <= t < vocab_size for t in ids):
        raise BadRequest(f"'token_ids' must be a non-empty list of token ids below {vocab_size}")
    if data.get("content_parts") or data.get("features"):
        raise BadRequest("multimodal requests (content_parts, features) are not supported")
    params = data.get("sampling_params") or {}
    if not isinstance(params, dict):
        raise BadRequest("'sampling_params' must be an object")
    stops = params.get("stop_token_ids") or []
    if not isinstance(stops, list) or not all(type(t) is int and 0 <= t < vocab_size for t in stops):
        raise BadRequest("'sampling_params.stop_token_ids' must be a list of token ids")
    max_tokens = params.get("max_tokens")
    if max_tokens is not None and (type(max_tokens) is not int or max_tokens < 1):
        raise BadRequest("'sampling_params.max_tokens' must be a positive integer")
    return Call(model, ids, stops, max_tokens)


class GenerateEndpoint:
    """The loopback HTTP server; ``route(model)`` registers the queue an episode's calls go to."""

    def __init__(self, vocab_size: int, max_model_len: int | None = None):
        self.vocab_size, self.max_model_len = vocab_size, max_model_len
        self._routes: dict[str, queue.Queue] = {}
        self._pending: set[Call] = set()
        self._lock = threading.Lock()
        self.server = _Server(("127.0.0.1", 0), _handler(self))
        self._thread = threading.Thread(target=self.server.serve_forever, args=(0.05,), name="vf-generate",
                                        daemon=True)
        self._thread.start()

    @property
    def base_url(self) -> str:
        """The OpenAI-style base URL the training client is given (generate is at the root)."""
        return f"http://127.0.0.1:{self.server.server_address[1]}/v1"

    def route(self, model: str) -> queue.Queue:
        """A fresh queue that receives the ``Call`` s of requests naming ``model``."""
        q: queue.Queue = queue.Queue()
        with self._lock:
            self._routes[model] = q
        return q

    def unroute(self, model: str) -> None:
        with self._lock:
            self._routes.pop(model, None)

    def models(self) -> dict[str, Any]:
        with self._lock:
            names = sorted(self._routes)
        return {"object": "list", "data": [{"id": m, "object": "model", "max_model_len": self.max_model_len}
                                           for m in names]}

    def submit(self, call: Call) -> queue.Queue | None:
        with self._lock:
            q = self._routes.get(call.model)
            if q is not None:
                self._pending.add(call)
        if q is not None:
            q.put(("call", call))
        return q

    def finished(self, call: Call) -> None:
        with self._lock:
            self._pending.discard(call)

    def close(self) -> None:
        """Stop serving; calls still waiting get HTTP 503."""
        with self._lock:
            pending, self._pending = list(self._pending), set()
        for call in pending:
            call.fail(503, "the endpoint is closed")
        self.server.shutdown()
        self.server.server_close()


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address) -> None:
        """A client that went away (its run was cancelled) is no error worth a traceback."""
        if isinstance(sys.exc_info()[1], ConnectionError):
            log.debug("verifiers endpoint: %s closed the connection", client_address)
            return
        super().handle_error(request, client_address)


def _handler(endpoint: GenerateEndpoint) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, fmt: str, *args) -> None:  # quiet: one line per request otherwise
            log.debug("verifiers endpoint: " + fmt, *args)

        def _send(self, status: int, payload: dict) -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            try:
                self.wfile.write(data)
            except (BrokenPipeError, ConnectionResetError):  # the client gave up (a cancelled run)
                self.close_connection = True

        def do_GET(self) -> None:
            if self.path.rstrip("/") in ("/v1/models", "/models"):
                self._send(200, endpoint.models())
            else:
                self._send(404, {"error": f"no route {self.path}"})

        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            if self.path.rstrip("/") != "/inference/v1/generate":
                self.rfile.read(length)
                self._send(404, {"error": f"no route {self.path}"})
                return
            if length > _MAX_BODY:
                self.close_connection = True
                self._send(413, {"error": "request over 256 MiB"})
                return
            try:
                call = parse_request(self.rfile.read(length), endpoint.vocab_size)
            except BadRequest as e:
                self._send(400, {"error": str(e)})
                return
            if endpoint.submit(call) is None:
                self._send(404, {"error": f"no episode is serving model {call.model!r}"})
                return
            call.wait()
            endpoint.finished(call)
            if call.status == 200:
                self._send(200, call.body())
            else:
                self._send(call.status, {"error": call.error})

    return Handler


__all__ = ["BadRequest", "Call", "GenerateEndpoint", "parse_request"]
