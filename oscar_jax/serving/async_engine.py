"""The engine on its own thread, fed by asyncio handlers.

Every engine call (add_request, abort, step) runs on the engine thread, so the engine needs no
locks; handlers hand work over through an inbox and receive outputs on an asyncio.Queue per
HTTP call. An add_request that the engine rejects (ValueError) fails the handler's future with
that error, which the server turns into a 400. With a StepMirror (several processes), the calls
that changed the schedule go to the other processes before each step (oscar_jax.serving.multihost).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import traceback

from oscar_jax.serving.engine import Engine, RequestOutput
from oscar_jax.serving.metrics import Metrics
from oscar_jax.serving.multihost import HEARTBEAT_S, StepMirror, encode_abort, encode_add, with_seed
from oscar_jax.serving.sampling import SamplingParams

log = logging.getLogger("oscar_jax.serving")


@dataclasses.dataclass(frozen=True)
class EngineFailure:
    """Delivered in place of an output when the engine failed while the request was live."""

    request_id: str
    message: str


class AsyncEngine:
    def __init__(self, engine: Engine, metrics: Metrics, mirror: StepMirror | None = None):
        self.engine, self.metrics, self.mirror = engine, metrics, mirror
        self._events: list[dict] = []  # the engine calls the mirror has not sent yet
        self._inbox: list = []
        self._wake = threading.Condition()
        self._routes: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stopped = False
        self._thread = threading.Thread(target=self._run, name="oscar-engine", daemon=True)
        self.failures = 0

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self._wake:
            self._stopped = True
            self._wake.notify()
        self._thread.join(timeout=30)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stopped

    async def add(self, prompt_ids: list[int], params: SamplingParams, request_id: str, tenant: str | None,
                  queue: asyncio.Queue) -> None:
        """Queue a request whose outputs go to `queue`; raises the engine's ValueError if rejected."""
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        self._post(("add", (prompt_ids, params, request_id, tenant), (loop, queue), done))
        await done

    def abort(self, request_id: str) -> None:
        self._post(("abort", request_id, None, None))

    def _post(self, item) -> None:
        with self._wake:
            self._inbox.append(item)
            self._wake.notify()

    # ------------------------------------------------------------------ engine thread

    def _deliver(self, request_id: str, item, finished: bool) -> None:
        route = self._routes.pop(request_id, None) if finished else self._routes.get(request_id)
        if route is not None:
            loop, queue = route
            loop.call_soon_threadsafe(queue.put_nowait, item)

    def _drain_inbox(self) -> None:
        with self._wake:
            items, self._inbox = self._inbox, []
        for kind, payload, route, done in items:
            if kind == "add":
                loop = route[0]
                prompt_ids, params, request_id, tenant = payload
                if self.mirror is not None:
                    params = with_seed(params)
                try:
                    self.engine.add_request(prompt_ids, params, request_id, tenant)
                except ValueError as err:
                    loop.call_soon_threadsafe(_settle, done, err)
                    continue
                self._record(encode_add(prompt_ids, params, request_id, tenant))
                self._routes[request_id] = route
                loop.call_soon_threadsafe(_settle, done, None)
            else:
                self._abort(payload)  # its final output arrives with the next step

    def _abort(self, request_id: str) -> None:
        if self.engine.abort(request_id):
            self._record(encode_abort(request_id))

    def _record(self, event: dict) -> None:
        if self.mirror is not None:
            self._events.append(event)

    def _send(self, *, stop: bool = False) -> None:
        if self.mirror is not None:
            events, self._events = self._events, []
            self.mirror.send(events, stop=stop)

    def _run(self) -> None:
        while True:
            with self._wake:
                while not (self._inbox or self._stopped or self.engine.has_work()):
                    # with a mirror, an idle wait ends in an empty message: a heartbeat
                    if not self._wake.wait(timeout=HEARTBEAT_S if self.mirror is not None else None):
                        break
                stopped = self._stopped
            if stopped:
                self._send(stop=True)
                return
            self._drain_inbox()
            self._send()
            if not self.engine.has_work():
                self.metrics.update(self.engine)
                continue
            try:
                outputs: list[RequestOutput] = self.engine.step()
            except Exception:  # keep serving: fail the live requests, not the server
                self.failures += 1
                message = traceback.format_exc()
                log.error("engine step failed; aborting the live requests\n%s", message)
                for request_id in list(self.engine.requests):
                    self._abort(request_id)
                    self._deliver(request_id, EngineFailure(request_id, message.strip().splitlines()[-1]), True)
                self.engine.step()  # drains the abort outputs (no device work: nothing is live)
                self.metrics.update(self.engine)
                continue
            self.metrics.update(self.engine)
            for output in outputs:
                self.metrics.observe(output)
                self._deliver(output.request_id, output, output.finished)


def _settle(future: asyncio.Future, error: Exception | None) -> None:
    if future.done():  # the handler was cancelled meanwhile
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)
