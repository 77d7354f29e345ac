"""The prefill worker's side of the KV transfer: which block ranges go out after each layer.

Each step, for every scheduled request that carries a TransferHandle, the blocks from the first not
yet sent (never below what the decode worker already caches) up to the last one this step touches
are shipped after each layer finishes, while the next layer computes. A chunk that ends inside a
block ships that block partly filled and ships it again, whole, with the next chunk, so every
write is of whole blocks. Blocks this worker found in its own prefix cache go out too: the
decode worker needs them, whoever computed them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from tandem.disagg.transport import KVSender, TransferHandle
from tandem.engine.scheduler import ScheduledRequest


class LayerwiseKVSend:
    def __init__(self, sender: KVSender, block_size: int) -> None:
        self.sender = sender
        self.block_size = block_size
        self._next_block: dict[str, int] = {}  # first block not yet sent complete, per request

    def plan(self, items: list[ScheduledRequest], kv_caches: torch.Tensor) -> Callable[[int], None] | None:
        sends: list[tuple[TransferHandle, torch.Tensor, list[int]]] = []
        progress: dict[str, int] = {}
        for item in items:
            handle: TransferHandle | None = item.request.kv_transfer
            if handle is None:
                continue
            rid = handle.request_id
            computed = item.request.num_computed_tokens + item.num_new_tokens
            start = max(self._next_block.get(rid, 0), handle.num_cached_blocks)
            end = -(-computed // self.block_size)
            if end > start:
                src = torch.tensor(item.block_ids[start:end], dtype=torch.long)
                sends.append((handle, src, handle.block_ids[start:end]))
            progress[rid] = max(start, computed // self.block_size)
        if not sends:
            self._next_block.update(progress)
            return None
        last_layer = kv_caches.shape[0] - 1

        def after_layer(layer: int) -> None:
            kv = kv_caches[layer]
            for handle, src, dst in sends:
                self.sender.write(handle, layer, dst, kv.index_select(1, src))
            if layer == last_layer:  # a step that fails before this is retried and sends it all again
                self._next_block.update(progress)

        return after_layer

    def reset(self, request_id: str) -> None:
        """The request starts over (its step was undone): send everything again."""
        self._next_block.pop(request_id, None)

    def finish(self, handle: TransferHandle) -> None:
        self._next_block.pop(handle.request_id, None)
        self.sender.finish(handle)

    def abort(self, request_id: str) -> None:
        self._next_block.pop(request_id, None)
        self.sender.abort(request_id)
