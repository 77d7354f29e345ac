"""KV transports move block contents bit-exactly, only into reserved blocks, only with the secret."""

from __future__ import annotations

import multiprocessing
import time

import pytest
import torch

from tandem.disagg.worker.transport import KVReceiver, TransferHandle, TransferResult
from tandem.disagg.worker.transports.factory import RoutingSender, make_receiver
from tandem.kv.pool import KVPool

SHAPE = (3, 2, 64, 16, 2, 8)  # layers, K/V, blocks, block size, kv heads, head dim
SECRET = b"s3cret"


def _layer_slices(seed: int, num_blocks: int, dtype: torch.dtype) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    # Random bit patterns, not just random values: every bit of every element must survive.
    raw = torch.randint(-(2**15), 2**15, (SHAPE[0], 2, num_blocks, *SHAPE[3:]), generator=g, dtype=torch.int16)
    return list((raw.view(dtype) if dtype.itemsize == 2 else raw.float().to(dtype)).unbind(0))


def _send(handle: TransferHandle, secret: bytes, seed: int, dtype: torch.dtype, timeout: float = 10.0
          ) -> TransferResult:
    sender = RoutingSender(secret)
    slices = _layer_slices(seed, len(handle.block_ids), dtype)
    dst = handle.block_ids[handle.num_cached_blocks:]
    for layer, kv in enumerate(slices):
        sender.write(handle, layer, dst, kv[:, handle.num_cached_blocks:])
    sender.finish(handle)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for result in sender.poll():
            sender.close()
            return result
        time.sleep(0.01)
    sender.close()
    return TransferResult(handle.request_id, False, "timed out")


def _send_in_child(handle: TransferHandle, secret: bytes, seed: int, dtype: torch.dtype, queue) -> None:  # noqa: ANN001
    queue.put(_send(handle, secret, seed, dtype))


def _open(kind: str, dtype: torch.dtype) -> KVReceiver:
    receiver = make_receiver(kind, "127.0.0.1", 0, SECRET)
    receiver.attach(KVPool.in_shared_memory(SHAPE, dtype) if receiver.needs_shared_pool
                    else KVPool.whole(torch.zeros(SHAPE, dtype=dtype)))
    return receiver


@pytest.mark.parametrize("kind", ["shm", "zmq"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_transport_is_bit_exact_across_processes(kind: str, dtype: torch.dtype) -> None:
    receiver = _open(kind, dtype)
    try:
        blocks = [40, 3, 17, 9, 58, 22]  # scattered, out of order
        handle = TransferHandle("r1", blocks, 2, receiver.endpoint)
        receiver.open("r1", blocks)
        ctx = multiprocessing.get_context("spawn")
        queue = ctx.Queue()
        proc = ctx.Process(target=_send_in_child, args=(handle, SECRET, 7, dtype, queue))
        proc.start()
        result = queue.get(timeout=60)
        proc.join(10)
        assert result.ok, result.error
        expected = _layer_slices(7, len(blocks), dtype)
        assert receiver.pool is not None
        for layer in range(SHAPE[0]):
            got = receiver.pool.local[layer][:, blocks[2:]]
            assert torch.equal(got.view(torch.uint8), expected[layer][:, 2:].contiguous().view(torch.uint8))
            # Cached blocks were not sent, and nothing outside the reservation was touched.
            untouched = [b for b in range(SHAPE[2]) if b not in blocks[2:]]
            assert not receiver.pool.local[layer][:, untouched].any()
        assert result.num_bytes == sum(t[:, 2:].numel() * t.element_size() for t in expected)
    finally:
        receiver.shutdown()


def test_zmq_refuses_a_wrong_secret() -> None:
    receiver = _open("zmq", torch.bfloat16)
    try:
        handle = TransferHandle("r1", [1, 2], 0, receiver.endpoint)
        receiver.open("r1", [1, 2])
        result = _send(handle, b"not the secret", 3, torch.bfloat16)
        assert not result.ok and "secret" in (result.error or "")
        assert receiver.pool is not None and not receiver.pool.local.any()
    finally:
        receiver.shutdown()


def test_zmq_refuses_writes_outside_an_open_reservation() -> None:
    receiver = _open("zmq", torch.bfloat16)
    try:
        handle = TransferHandle("r1", [1, 2, 3], 0, receiver.endpoint)
        receiver.open("r1", [1, 2])  # block 3 is not this request's
        result = _send(handle, SECRET, 3, torch.bfloat16)
        assert not result.ok and "outside" in (result.error or "")
        receiver.close("r1")
        late = _send(TransferHandle("r1", [1, 2], 0, receiver.endpoint), SECRET, 4, torch.bfloat16)
        assert not late.ok and "no open reservation" in (late.error or "")
        assert receiver.pool is not None and not receiver.pool.local[:, :, 3].any()
    finally:
        receiver.shutdown()
