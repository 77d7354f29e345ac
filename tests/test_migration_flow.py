"""The router's side of a live migration on scripted workers: what it asks the source and the
target, in order, and how each failure ends: the target refusing or dying resumes the request on
the source (the target's reservation aborted); the source dying fails it; a transfer that
succeeds admits it on the target with the newest token."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from tandem.disagg.router.dispatch import Dispatcher
from tandem.disagg.router.flight import Flight, Phase, WorkerLost
from tandem.disagg.router.registry import WorkerHandle, WorkerRegistry
from tandem.disagg.router.settings import RouterCounters, RouterSettings
from tandem.disagg.worker.messages import (
    Admit,
    Migrated,
    MigrateKV,
    Pause,
    Paused,
    Reserve,
    Reserved,
    ReserveFailed,
    Resume,
    WorkerInfo,
)
from tandem.disagg.worker.transport import KVEndpoint, TransferHandle, TransferResult
from tandem.engine.core_report import CoreInfo
from tandem.engine.core_request import EngineCoreRequest
from tandem.engine.messages import AbortRequests
from tandem.policy.paths import Slo
from tandem.policy.routing import Router, RoutingSettings
from tandem.sampling_params import SamplingParams

OUTPUT = [11, 12, 13]
ENDPOINT = KVEndpoint("shm", "/proc/1/fd/3", "h", (1, 2, 8, 16, 1, 64), "float32")

Script = Callable[[WorkerHandle, object], object | None]  # the reply a worker gives a message (None: silence)


class Scripted:
    def __init__(self, script: Script) -> None:
        self.registry = WorkerRegistry(30.0)
        self.sent: list[tuple[str, object]] = []
        self.script = script
        info = CoreInfo(4096, 100, None, 64, "m", block_size=16)
        self.dispatch = Dispatcher(RouterSettings(heartbeat_timeout=1.0, reserve_timeout=1.0, prefill_timeout=1.0),
                                   self.registry, Router(RoutingSettings(), self.registry.index, lambda w: 0),
                                   Slo(2.0, 0.1), "slo", self._send, self._deliver, RouterCounters())
        self.dispatch.info = info
        self.source, self.target = (self.registry.join(wid.encode(), WorkerInfo(wid, "colocated", info, None, "h", i,
                                                                                   None))
                                    for i, wid in enumerate(("w0", "w1")))
        self.flight = Flight(EngineCoreRequest("r", tuple(range(40)), SamplingParams(max_tokens=32, seed=5)))
        self.flight.phase, self.flight.streamed = Phase.WHOLE, True
        self.dispatch.assign(self.flight, None, self.source)

    async def _send(self, worker: WorkerHandle, msg: object) -> bool:
        self.sent.append((worker.worker_id, msg))
        reply = self.script(worker, msg)
        if isinstance(reply, Exception):
            assert self.flight.reply is not None
            worker.alive = False
            asyncio.get_running_loop().call_soon(self.flight.reply.set_exception, reply)
        elif reply is not None:
            asyncio.get_running_loop().call_soon(self.dispatch.on_reply, self.flight, reply)
        return True

    async def _deliver(self, outputs: list) -> None:
        pass

    def migrate(self) -> str | None:
        return asyncio.run(self.dispatch.migrate(self.flight, self.target))

    def kinds(self, worker_id: str) -> list[type]:
        return [type(m) for w, m in self.sent if w == worker_id]


def answers(target_reply: Callable[[Reserve], object | None], source_migrate: object | None) -> Script:
    def script(worker: WorkerHandle, msg: object) -> object | None:
        if isinstance(msg, Pause):
            return Paused(msg.request_id, list(OUTPUT))
        if isinstance(msg, Reserve):
            return target_reply(msg)
        if isinstance(msg, MigrateKV):
            return source_migrate
        return None

    return script


def reserved(msg: Reserve) -> Reserved:
    return Reserved(msg.request.request_id, TransferHandle("r", [4, 5, 6], 1, ENDPOINT, "w1"))


def test_a_move_that_lands_admits_the_request_on_the_target_with_its_newest_token() -> None:
    c = Scripted(answers(reserved, Migrated("r", True, TransferResult("r", True, num_bytes=4096))))
    assert c.migrate() is None
    assert c.kinds("w0") == [Pause, MigrateKV] and c.kinds("w1") == [Reserve, Admit]
    [reserve] = [m for w, m in c.sent if isinstance(m, Reserve)]
    # The target's copy: the prompt and every output token but the newest, whose KV arrives computed.
    assert reserve.request.output_token_ids == tuple(OUTPUT[:-1]) and reserve.request.num_tokens == 40 + len(OUTPUT) - 1
    assert reserve.request.sampling_params.seed == 5
    [admit] = [m for w, m in c.sent if isinstance(m, Admit)]
    assert admit.first_token == OUTPUT[-1]
    assert c.flight.decode is c.target and c.flight.prefill is None and c.flight.phase == Phase.WHOLE
    assert "r" in c.target.inflight and "r" not in c.source.inflight
    assert c.dispatch.counters.migrations == 1 and c.dispatch.counters.transfers[("w0", "w1")] == (1, 4096)


def test_a_target_without_room_leaves_the_request_decoding_on_the_source() -> None:
    c = Scripted(answers(lambda m: ReserveFailed(m.request.request_id, "no free blocks"), None))
    assert "no room" in (c.migrate() or "")
    assert c.kinds("w0") == [Pause, Resume] and c.kinds("w1") == [Reserve, AbortRequests]
    assert c.flight.decode is c.source and c.flight.phase == Phase.WHOLE and "r" not in c.target.inflight


def test_a_transfer_that_fails_resumes_on_the_source() -> None:
    c = Scripted(answers(reserved, Migrated("r", False, reason="connection refused")))
    assert "transfer failed" in (c.migrate() or "")
    assert c.kinds("w0") == [Pause, MigrateKV, Resume] and c.kinds("w1") == [Reserve, AbortRequests]
    assert c.flight.decode is c.source and c.dispatch.counters.migrations == 0


def test_a_target_that_dies_mid_move_resumes_on_the_source() -> None:
    c = Scripted(answers(lambda m: WorkerLost("worker w1 died"), None))
    assert "died" in (c.migrate() or "")
    assert c.kinds("w0") == [Pause, Resume] and c.kinds("w1") == [Reserve]  # nothing sent to the dead
    assert c.flight.decode is c.source


def test_a_source_that_dies_mid_move_fails_the_request() -> None:
    c = Scripted(answers(reserved, WorkerLost("worker w0 died")))
    with pytest.raises(WorkerLost, match="died while its request was moving"):
        c.migrate()
    assert c.kinds("w1") == [Reserve, AbortRequests]  # its reservation is taken back
    assert Resume not in c.kinds("w0")


def test_a_request_that_is_not_decoding_stays() -> None:
    c = Scripted(lambda w, m: Paused(m.request_id, None, "still in its prompt") if isinstance(m, Pause) else None)
    assert c.migrate() == "still in its prompt"
    assert c.kinds("w1") == [] and c.flight.decode is c.source


def test_a_source_that_never_answers_the_shipment_keeps_the_request_and_the_target_its_reservation() -> None:
    """It may be writing into the reservation still: freeing those blocks now could let its writes
    land in another request's; the target takes the reservation back when it expires."""
    c = Scripted(answers(reserved, None))
    assert "no answer" in (c.migrate() or "")
    assert c.kinds("w0") == [Pause, MigrateKV, Resume] and c.kinds("w1") == [Reserve]
