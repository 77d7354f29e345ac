"""The messages an engine service exchanges with whoever feeds it requests: the colocated server's
API process, or a cluster's router. Typed, so each side dispatches on the class, not on a string.

  in:  AddRequests, AbortRequests, ReleaseKV, Shutdown
  out: Ready (or StartupFailed) once, then StepOutputs after steps (and as a heartbeat), RequestsFailed,
       KVEvents when a step changed the prefix cache
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tandem.engine.core_output import EngineCoreOutput
from tandem.engine.core_report import CoreInfo, CoreStats
from tandem.engine.core_request import EngineCoreRequest


@dataclass
class AddRequests:
    requests: list[EngineCoreRequest]


@dataclass
class AbortRequests:
    request_ids: list[str]


@dataclass
class ReleaseKV:
    """Stored conversations' KV that no longer needs keeping (a handle no engine knows is ignored)."""

    handles: list[str]


@dataclass
class Shutdown:
    pass


@dataclass
class Ready:
    info: CoreInfo


@dataclass
class StartupFailed:
    reason: str


@dataclass
class StepOutputs:
    outputs: list[EngineCoreOutput]
    stats: CoreStats | Any  # a cluster worker's WorkerStats wraps the CoreStats with its transfers


@dataclass
class RequestsFailed:
    request_ids: list[str]
    message: str


@dataclass
class KVEvents:
    events: list  # BlockStored | BlockRemoved (kv/block_pool.py), in order
    seq: int = 0  # counts the batches a publisher sent: a gap means one was dropped
    worker_id: str | None = None  # set by a router publishing its workers' events: whose pool, whose seq
