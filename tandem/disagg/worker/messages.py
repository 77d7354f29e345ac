"""What the router and its workers say to each other: typed messages, signed on the wire (wire.py).

Besides the engine's own (engine/messages.py: AddRequests, AbortRequests, Shutdown in; StepOutputs,
RequestsFailed, KVEvents out), which a worker's engine service handles like the colocated core's:

  router -> worker: Reserve, Prefill, Admit, Forget, Hello; Pause, MigrateKV, Resume (a live migration)
  worker -> router: Register, Alive, Reserved | ReserveFailed, Prefilled | TransferFailed, Aborted,
                    Paused, Migrated

Reserved, ReserveFailed, Prefilled, TransferFailed, Paused and Migrated answer a question the router
asked about one request (a FlightReply): the request's task waits for them.

A live migration moves a decoding request to another worker with its KV: the source pauses it
(Paused: its output so far), the target reserves blocks for everything computed (the prompt and
all but the newest token) as a decode worker reserves a prompt, the source ships those blocks
into the reservation and lets the request go (Migrated), and the target is admitted with the
newest token, decoding on from there.
"""

from __future__ import annotations

from dataclasses import dataclass

from tandem.disagg.worker.transport import KVEndpoint, TransferHandle, TransferResult, TransferStats
from tandem.engine.core_output import EngineCoreOutput
from tandem.engine.core_report import CoreInfo, CoreStats
from tandem.engine.core_request import EngineCoreRequest

ROLES = ("prefill", "decode", "colocated")
RECEIVING_ROLES = ("decode", "colocated")  # their pools take KV from other workers (prefills, migrations)


@dataclass
class WorkerInfo:
    worker_id: str
    role: str
    core: CoreInfo
    kv_endpoint: KVEndpoint | None  # decode workers: where their KV lands
    host: str
    pid: int
    cores: list[int] | None


@dataclass
class WorkerStats:
    core: CoreStats
    transfer: TransferStats


# -- router -> worker -------------------------------------------------------------------------
@dataclass
class Reserve:
    """Decode worker: allocate blocks for this prompt, whose KV another worker computes."""

    request: EngineCoreRequest


@dataclass
class Prefill:
    """Compute the prompt (max_tokens 1) and ship its KV layer by layer to the reservation."""

    request: EngineCoreRequest
    handle: TransferHandle


@dataclass
class Admit:
    """Decode worker: the KV landed; decode on from the prefill's token (a seeded request's noise is
    a function of its seed and position: nothing of the prefill's random state needs to travel)."""

    request_id: str
    first_token: int


@dataclass
class Pause:
    """Hold this decoding request between steps, blocks and all (a migration's first step)."""

    request_id: str


@dataclass
class MigrateKV:
    """Ship the paused request's computed KV into the reservation, then let the request go."""

    request_id: str
    handle: TransferHandle


@dataclass
class Resume:
    """The migration did not happen: decode the paused request on here."""

    request_id: str


@dataclass
class Forget:
    """A decode worker is gone: drop the connection to its KV endpoint."""

    kv_address: str


@dataclass
class Hello:
    """Who are you? (the router does not know this peer: a restart on either side)"""


# -- worker -> router -------------------------------------------------------------------------
@dataclass
class Register:
    info: WorkerInfo


@dataclass
class Alive:
    """Still here: sent from the worker's heartbeat thread while a long step keeps its loop busy."""


@dataclass
class FlightReply:
    request_id: str


@dataclass
class Reserved(FlightReply):
    handle: TransferHandle


@dataclass
class ReserveFailed(FlightReply):
    reason: str


@dataclass
class Prefilled(FlightReply):
    output: EngineCoreOutput  # the first token
    result: TransferResult | None


@dataclass
class TransferFailed(FlightReply):
    reason: str


@dataclass
class Aborted:
    """The worker stopped these requests: no further write of theirs lands anywhere."""

    request_ids: list[str]


@dataclass
class Paused(FlightReply):
    """output_token_ids: the request's output so far (its KV is computed up to the newest token);
    None: it cannot move now (reason says why), and it decodes on."""

    output_token_ids: list[int] | None
    reason: str = ""


@dataclass
class Migrated(FlightReply):
    """ok: the KV landed in the reservation and the request is gone from here; else it is paused
    here still (the router resumes or aborts it)."""

    ok: bool
    result: TransferResult | None = None
    reason: str = ""
