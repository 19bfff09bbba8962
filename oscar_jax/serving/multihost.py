"""Serving across processes (one per host, `jax.distributed`): process 0 runs the HTTP server and
decides what each engine step takes in; every other process runs the same engine on the same
inputs, so all processes run the same sharded steps in lockstep, as `oscar_jax.generate` does.

Before each step process 0 sends, in order, the engine calls that changed the schedule since the
last one (add_request with the seed already drawn, abort) as JSON bytes through
`jax.experimental.multihost_utils.broadcast_one_to_all`, a collective over every process's
devices. Given the same calls, every engine takes the same decisions: the scheduler and the page
allocator are deterministic and sampling is seeded per request. Process 0 also sends an empty
message when idle for HEARTBEAT_S, so the others never wait in a collective for long, and a
stop message when it shuts down.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import secrets

import jax
import numpy as np
from jax.experimental import multihost_utils

from oscar_jax.serving.engine import Engine
from oscar_jax.serving.sampling import SamplingParams

log = logging.getLogger("oscar_jax.serving")

HEARTBEAT_S = 1.0
_MIN_CAPACITY = 1024  # bytes: messages are padded to a power of two, so few sizes are compiled


def with_seed(params: SamplingParams) -> SamplingParams:
    """The request's parameters with its seed drawn here when it has none (every process must
    sample with the same seed; the engine would draw its own otherwise)."""
    return params if params.seed is not None else dataclasses.replace(params, seed=secrets.randbits(63))


def encode_add(prompt_ids, params: SamplingParams, request_id: str, tenant: str | None) -> dict:
    return {"add": [[int(t) for t in np.asarray(prompt_ids).reshape(-1)], dataclasses.asdict(params), request_id,
                    tenant]}


def encode_abort(request_id: str) -> dict:
    return {"abort": request_id}


def apply_events(engine: Engine, events: list[dict]) -> None:
    """Replay process 0's engine calls, in its order."""
    for event in events:
        if "add" in event:
            prompt, params, request_id, tenant = event["add"]
            params = SamplingParams(**{**params, "stop": tuple(params["stop"]),
                                       "stop_token_ids": tuple(params["stop_token_ids"])})
            engine.add_request(prompt, params, request_id, tenant)
        else:
            engine.abort(event["abort"])


class StepMirror:
    """The channel from process 0 to the others: `send` on process 0, `receive` elsewhere; each
    call on process 0 matches one call on every other process."""

    def __init__(self):
        if jax.process_count() < 2:
            raise ValueError(f"a StepMirror needs several processes; jax.process_count()={jax.process_count()}")
        self.is_source = jax.process_index() == 0

    def send(self, events: list[dict], *, stop: bool = False) -> None:
        assert self.is_source, "only process 0 sends"
        self._broadcast(json.dumps({"events": events, "stop": stop}).encode())

    def receive(self) -> list[dict] | None:
        """The next step's events, or None when process 0 stops."""
        assert not self.is_source, "process 0 sends"
        message = json.loads(self._broadcast(b"").decode())
        return None if message["stop"] else message["events"]

    def _broadcast(self, payload: bytes) -> bytes:
        size = int(multihost_utils.broadcast_one_to_all(np.array(len(payload), np.int32), is_source=self.is_source))
        capacity = max(_MIN_CAPACITY, 1 << max(size - 1, 0).bit_length())
        buffer = np.zeros(capacity, np.uint8)
        if self.is_source:
            buffer[:size] = np.frombuffer(payload, np.uint8)
        out = multihost_utils.broadcast_one_to_all(buffer, is_source=self.is_source)
        return np.asarray(out)[:size].tobytes()


def follow(engine: Engine, mirror: StepMirror) -> int:
    """A non-zero process's serving loop: replay process 0's calls and step when it does (it
    steps exactly when its engine has work after the calls, as process 0's does). Returns the
    number of steps run, when process 0 stops."""
    steps = 0
    while (events := mirror.receive()) is not None:
        apply_events(engine, events)
        if not engine.has_work():
            continue
        try:
            engine.step()
        except Exception:  # as process 0 does: fail the live requests (their aborts also arrive from it)
            log.exception("engine step failed; aborting the live requests")
            for request_id in list(engine.requests):
                engine.abort(request_id)
            engine.step()
        steps += 1
    return steps
