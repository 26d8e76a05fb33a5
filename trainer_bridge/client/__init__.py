"""``RolloutClient``: the trainer's async HTTP client for one or many ``rollout-serve`` servers.

Token ids in, ``Sample`` records out::

    async with RolloutClient(["http://127.0.0.1:30000", "http://127.0.0.1:30001"]) as client:
        samples = await client.generate_groups(prompt_ids, n=8,
                                               sampling_params={"temperature": 1.0, "max_new_tokens": 16})

Behaviour:
- Balance: each request goes to the live server with the fewest requests outstanding from this
  client (ties: round robin).
- Every request carries an explicit ``rid`` and ``sampling_seed``. A request that fails on a
  server (connection refused or reset, HTTP 5xx, timeout) is sent again, with the same ``rid`` and
  seed, to another server; a 503, or a transport error after which ``/health`` does not answer,
  marks the server dead (``revive`` brings it back). Each request resolves exactly once, so no
  sample is lost and none is duplicated.
- Pause/abort: a request that comes back ``finish_reason: abort`` without this client having
  aborted it (a ``/pause_generation`` in ``abort`` mode, an admin ``abort_all``) is submitted again
  (servers queue new requests while paused, so it runs after ``/continue_generation``). While this
  client is paused (``pause``) it sends nothing new. ``abort`` aborts this client's requests in
  flight: they resolve as partial samples (``meta["finish_reason"] == "abort"``), never retried
  (requests not yet sent are not affected: cancel the ``generate_*`` task to drop them).
- A request that fails before any response byte (a pooled connection the server closed just as
  the request was written: ``RemoteProtocolError``/``ReadError``/``WriteError``/``ConnectError``)
  is sent again at once on a fresh connection (same ``rid``), up to ``STALE_CONNECTION_RETRIES``
  times, without counting as a failed attempt.
- Streaming (``stream=True``): SSE chunks are assembled (tokens, logprobs and the routing rows that
  became final in each chunk); a stream cut off mid-way is retried like any failed request.
- Routing is decoded with ``capture.codec`` into ``[T - 1, num_layers, top_k]`` int32 tensors and
  each sample is validated on arrival (``Sample.validate``: shape against the token count, ids in
  ``[0, num_experts)``, k distinct ids per MoE row); a bad sample raises ``SampleError`` naming its
  ``rid`` and server.
- ``loads()``: this client's per-server counters; ``await server_loads()``: each server's
  ``/v1/loads``.

Modules: ``rollout_client`` (``RolloutClient``, the facade: lifecycle, balancing, the retry loop),
``transport`` (one ``/generate`` try on one server), ``stream`` (SSE assembly), ``response`` (a
response read into a ``Sample``), ``health`` (which servers are alive), ``control`` (pause,
abort, ``/model_info``, loads, weight versions), ``errors``, ``server_state``, ``request``,
``model_info``.
"""
from __future__ import annotations

from .errors import RID_IN_FLIGHT, NoServerError, RequestRejected, RolloutError, SampleError  # noqa: F401
from .model_info import ModelInfo
from .request import Request  # noqa: F401
from .rollout_client import ROUTING_FORMATS, RolloutClient  # noqa: F401
from .server_state import ServerState  # noqa: F401
from .transport import STALE_CONNECTION_RETRIES  # noqa: F401

__all__ = ["RolloutClient", "ModelInfo", "RolloutError", "NoServerError", "SampleError", "RequestRejected"]
