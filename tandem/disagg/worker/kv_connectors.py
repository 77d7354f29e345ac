"""Prefill/decode disaggregation as two KV connectors: the engine itself knows nothing of it.

`KVSendConnector` (prefill worker): each step, for every scheduled request the worker is sending,
the blocks from the first not yet sent (never below what the decode worker already caches) up to
the last one this step touches are shipped after each layer finishes, while the next layer
computes. A chunk that ends inside a block ships that block partly filled and ships it again,
whole, with the next chunk, so every write is of whole blocks. Blocks this worker found in its own
prefix cache (or loaded from the store) go out too: the decode worker needs them, whoever computed
them. The router sends the request with max_tokens 1, so it ends after its first token like any
request; when it ends the transfer is finished (or aborted), and the worker reports the first token
once the sender says the KV has landed.

`KVRecvConnector` (decode worker): a request the worker was told to expect is admitted by the
scheduler as a load of its whole prompt (past the pool's own prefix hits): its blocks are allocated
and opened for the prefill worker's writes, and the handle goes back to the router. When the router
says the KV is in place, along with the token the prefill worker sampled and its random state, the
load finishes: the scheduler caches the blocks, and the connector appends that token, so decoding
continues exactly where the prefill worker stopped.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from tandem.disagg.worker.transport import KVReceiver, KVSender, TransferHandle
from tandem.engine.connectors.base import FinishedTransfers, KVConnector
from tandem.engine.request import Request, RequestStatus
from tandem.engine.step import ConnectorMeta, ScheduledRequest
from tandem.kv.pool import KVPool


@dataclass
class _SendPlan(ConnectorMeta):
    sends: list[tuple[TransferHandle, torch.Tensor, list[int]]] = field(default_factory=list)
    progress: dict[str, int] = field(default_factory=dict)  # request id -> blocks complete after the step


class KVSendConnector(KVConnector[_SendPlan]):
    def __init__(self, sender: KVSender, block_size: int) -> None:
        self.sender = sender
        self.block_size = block_size
        self._handles: dict[str, TransferHandle] = {}
        self._next_block: dict[str, int] = {}  # first block not yet sent complete, per request
        self._kv: KVPool | None = None
        self._plan: _SendPlan | None = None

    def send_to(self, handle: TransferHandle) -> None:
        """The request with this id (added next) ships its KV to the handle's blocks."""
        self._handles[handle.request_id] = handle

    def forget(self, request_id: str) -> None:
        """The request never made it into the engine."""
        self._handles.pop(request_id, None)

    # -- scheduler half -------------------------------------------------------------------------
    def build_step(self, items: list[ScheduledRequest]) -> _SendPlan | None:
        plan = _SendPlan()
        for item in items:
            handle = self._handles.get(item.request.request_id)
            if handle is None:
                continue
            rid = handle.request_id
            computed = item.request.num_computed_tokens + item.num_new_tokens
            start = max(self._next_block.get(rid, 0), handle.num_cached_blocks)
            end = -(-computed // self.block_size)
            if end > start:
                src = torch.tensor(item.block_ids[start:end], dtype=torch.long)
                plan.sends.append((handle, src, handle.block_ids[start:end]))
            plan.progress[rid] = max(start, computed // self.block_size)
        return plan if plan.progress else None

    def request_finished(self, request: Request, block_ids: list[int]) -> bool:
        handle = self._handles.pop(request.request_id, None)
        self._next_block.pop(request.request_id, None)
        if handle is not None:
            if request.status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH):
                self.sender.finish(handle)  # every layer of the last step was written in the forward pass
            else:
                self.sender.abort(request.request_id)
        return False  # each write copied its blocks out: nothing reads the pool after the step

    def reset(self, request_id: str) -> None:
        """The request starts over (its step was undone): send everything again."""
        self._next_block.pop(request_id, None)

    def migrate(self, handle: TransferHandle, block_ids: list[int], num_computed_tokens: int) -> str | None:
        """A paused request's computed blocks (block_ids, the pool's, in order) past what the target
        caches, every layer at once into the target's reservation, then fenced: the sender reports when
        they landed. None once sent, else why not."""
        end = -(-num_computed_tokens // self.block_size)
        if end > len(handle.block_ids) or end > len(block_ids):
            return f"the reservation holds {len(handle.block_ids)} blocks, the request {end}"
        assert self._kv is not None
        start = handle.num_cached_blocks
        if end > start:
            index = torch.tensor(block_ids[start:end], dtype=torch.long)
            for layer in range(self._kv.shape[0]):
                self.sender.write(handle, layer, handle.block_ids[start:end], self._kv.read_layer(layer, index))
        self.sender.finish(handle)
        return None

    # -- worker half ----------------------------------------------------------------------------
    def register_kv_caches(self, pool: KVPool) -> None:
        self._kv = whole_pool(pool)

    def start_step(self, meta: _SendPlan | None) -> None:
        self._plan = meta

    @property
    def has_layer_work(self) -> bool:
        return self._plan is not None and bool(self._plan.sends)

    def save_layer(self, layer: int) -> None:
        assert self._plan is not None and self._kv is not None
        for handle, src, dst in self._plan.sends:  # every KV head: a worker group's ranks' too
            self.sender.write(handle, layer, dst, self._kv.read_layer(layer, src))

    def finish_step(self) -> None:
        # Reached only when the forward pass completed: a step that fails is retried and sends it all again.
        if self._plan is not None:
            self._next_block.update(self._plan.progress)
        self._plan = None


def whole_pool(pool: KVPool) -> KVPool:
    """A pool whose every KV head this process reads and writes: what sending and receiving move."""
    if not pool.complete:
        raise ValueError(f"a worker group on {pool.device} cannot share its ranks' KV pools with rank 0 "
                         "(only CPU groups do): run this worker with one process")
    return pool


class KVRecvConnector(KVConnector):
    def __init__(self, receiver: KVReceiver, block_size: int, worker_id: str = "") -> None:
        self.receiver = receiver
        self.block_size = block_size
        self.worker_id = worker_id
        self._expected: set[str] = set()
        self._loading: dict[str, int] = {}  # request id -> tokens the prefill worker writes
        self._reserved: list[TransferHandle] = []
        self._arrived: dict[str, int] = {}  # KV in place: the first token
        self._landed: dict[str, int] = {}

    def expect(self, request_id: str) -> None:
        """The request with this id (added next) gets its prompt's KV from a prefill worker."""
        self._expected.add(request_id)

    def take_reserved(self) -> list[TransferHandle]:
        """Handles for the requests whose blocks were allocated since the last call."""
        out, self._reserved = self._reserved, []
        return out

    def arrived(self, request_id: str, first_token: int) -> bool:
        """The prefill worker's KV is in place; False if the reservation is gone (aborted or expired)."""
        if request_id not in self._loading or request_id in self._arrived:
            return False
        self.receiver.close(request_id)  # no write may land once decoding reads these blocks
        self._arrived[request_id] = first_token
        return True

    # -- scheduler half -------------------------------------------------------------------------
    def num_loadable_tokens(self, request: Request, num_computed_tokens: int) -> int:
        if request.request_id not in self._expected:
            return 0  # a local request, or one recomputed here after a preemption
        self._expected.discard(request.request_id)
        return request.num_tokens - num_computed_tokens  # the whole prompt arrives: nothing is computed here

    def on_allocated(self, request: Request, block_ids: list[int], num_computed_tokens: int,
                     num_external_tokens: int) -> None:
        rid = request.request_id
        self.receiver.open(rid, block_ids)
        self._loading[rid] = num_external_tokens
        self._reserved.append(TransferHandle(rid, block_ids, num_computed_tokens // self.block_size,
                                             self.receiver.endpoint, self.worker_id))

    def busy(self) -> bool:
        return bool(self._arrived)

    # -- worker half ----------------------------------------------------------------------------
    def register_kv_caches(self, pool: KVPool) -> None:
        self.receiver.attach(whole_pool(pool))  # the prefill workers write into it from now on

    def take_finished(self) -> FinishedTransfers:
        loads = {rid: self._loading.pop(rid) for rid in self._arrived}
        self._landed.update(self._arrived)
        self._arrived = {}
        return FinishedTransfers(loads)

    def on_load_finished(self, request: Request, num_loaded_tokens: int) -> None:
        request.append_output_token(self._landed.pop(request.request_id))
        request.first_token_time = time.monotonic()

    def request_finished(self, request: Request, block_ids: list[int]) -> bool:
        rid = request.request_id
        self._expected.discard(rid)
        self._landed.pop(rid, None)
        self._arrived.pop(rid, None)
        if self._loading.pop(rid, None) is not None:
            self.receiver.close(rid)  # before its blocks go back to the pool
        return False
