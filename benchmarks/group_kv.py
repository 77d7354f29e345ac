"""What moving whole blocks in and out of a worker group's split pool costs (kv/pool.py), against a
one-process pool: the default model's KV shape (30 layers, 3 KV heads of 64, float32, blocks of 16).

    .venv/bin/python benchmarks/group_kv.py                 # 64 and 512 blocks, best of 5

Per pool split (one part; TP 2: heads 2 + 1; TP 3: 1 + 1 + 1), per number of blocks:
  receive  a prefill worker's shared-memory sender writing every layer of the blocks into the decode
           pool (the real ShmReceiver / ShmSender pair), the blocks re-split by head on the way;
  send     a prefill group's rank 0 reading every layer of the blocks, every head (what it ships);
  save     the store's copy-out of the blocks (read_blocks: all layers of a block contiguous);
  load     the store's copy-in, one block at a time (write_block, numpy memcpy per part).
Reported as GB/s of KV and as the split pool's time over the whole pool's.
Results: benchmarks/results/group_kv.json.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable
from pathlib import Path

import torch

from tandem.disagg.worker.transport import TransferHandle
from tandem.disagg.worker.transports.shm import ShmReceiver, ShmSender
from tandem.kv.pool import KVPool, PoolPart, shared_zeros

RESULTS = Path(__file__).resolve().parent / "results" / "group_kv.json"
LAYERS, HEADS, HEAD_DIM, BLOCK = 30, 3, 64, 16
SPLITS = {"whole": [(0, 3)], "tp2": [(0, 2), (2, 3)], "tp3": [(0, 1), (1, 2), (2, 3)]}


def pool(split: list[tuple[int, int]], num_blocks: int) -> KVPool:
    parts = []
    for h0, h1 in split:
        tensor, where = shared_zeros((LAYERS, 2, num_blocks, BLOCK, h1 - h0, HEAD_DIM), torch.float32)
        tensor.fill_(1.0)  # committed: no first-touch faults in the timings
        parts.append(PoolPart((h0, h1), tensor, where))
    return KVPool(parts, HEADS)


def best(fn: Callable[[], None], repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def measure(split: list[tuple[int, int]], n: int, repeats: int) -> dict[str, float]:
    dst, src = pool(split, n), pool(split, n)
    ids = list(range(n))
    index = torch.tensor(ids)
    receiver, sender = ShmReceiver(), ShmSender()
    receiver.attach(dst)
    layers = [torch.randn(2, n, BLOCK, HEADS, HEAD_DIM) for _ in range(LAYERS)]

    def receive() -> None:
        receiver.open("r", ids)
        handle = TransferHandle("r", ids, 0, receiver.endpoint)
        for layer, kv in enumerate(layers):
            sender.write(handle, layer, ids, kv)
        sender.finish(handle)
        assert all(r.ok for r in sender.poll())
        receiver.close("r")

    def send() -> None:
        for layer in range(LAYERS):
            src.read_layer(layer, index)

    saved = src.read_blocks(index)
    raw = [saved[i].view(torch.uint8).numpy().reshape(-1) for i in range(n)]

    def load() -> None:
        for i, block in enumerate(raw):
            dst.write_block(i, block)

    out = {"receive": best(receive, repeats), "send": best(send, repeats),
           "save": best(lambda: src.read_blocks(index), repeats), "load": best(load, repeats)}
    sender.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", default="64,512")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args()
    torch.set_num_threads(1)  # what a worker's transfer thread has; the copies are memory-bound
    results: dict[str, dict[str, dict[str, float]]] = {}
    for n in map(int, args.blocks.split(",")):
        nbytes = n * LAYERS * 2 * BLOCK * HEADS * HEAD_DIM * 4
        for name, split in SPLITS.items():
            seconds = measure(split, n, args.repeats)
            results.setdefault(str(n), {})[name] = seconds
            whole = results[str(n)]["whole"]
            print(f"{n:4d} blocks ({nbytes / 2**20:6.1f} MiB) {name:5s}  " + "  ".join(
                f"{k} {nbytes / s / 1e9:5.2f} GB/s ({s / whole[k]:.2f}x)" for k, s in seconds.items()), flush=True)
    args.results.parent.mkdir(parents=True, exist_ok=True)
    args.results.write_text(json.dumps(results, indent=1))
    print(f"wrote {args.results}")


if __name__ == "__main__":
    main()
