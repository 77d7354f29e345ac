"""What a request costs to cross a process boundary: the bytes of an AddRequests message as the API
process or a router sends it (pickled, as the transports do before signing), and the time to encode
it, decode it and build the engine's own Request from it. The frozen wire type (engine/core_request.py,
issue #48) against the scheduler's Request it replaced, for prompts of a few lengths.

    .venv/bin/python benchmarks/request_encoding.py
    .venv/bin/python benchmarks/request_encoding.py --prompts 16,256,2048,8192 --rounds 5000

Results: benchmarks/results/request_encoding.json.
"""

from __future__ import annotations

import argparse
import json
import pickle
import time
from pathlib import Path

from tandem.engine.core_request import EngineCoreRequest
from tandem.engine.messages import AddRequests
from tandem.engine.request import Request
from tandem.sampling_params import SamplingParams

RESULTS = Path(__file__).resolve().parent / "results" / "request_encoding.json"


def round_trip_us(message: AddRequests, to_engine: bool, rounds: int) -> float:
    start = time.perf_counter()
    for _ in range(rounds):
        [r] = pickle.loads(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)).requests
        if to_engine:
            Request.from_core_request(r)
    return (time.perf_counter() - start) / rounds * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", default="16,256,2048", help="prompt lengths, comma-separated")
    ap.add_argument("--rounds", type=int, default=2000)
    args = ap.parse_args()
    params = SamplingParams(max_tokens=64, temperature=0.8, top_p=0.95, seed=7)
    rows = []
    for n in (int(x) for x in args.prompts.split(",")):
        ids = list(range(1000, 1000 + n))
        scheduler = AddRequests([Request("r" * 32, ids, params, (2,))])  # what was sent before: the engine's type
        wire = AddRequests([EngineCoreRequest("r" * 32, tuple(ids), params, (2,))])
        row = {"prompt_tokens": n,
               "scheduler_request_bytes": len(pickle.dumps(scheduler, protocol=pickle.HIGHEST_PROTOCOL)),
               "wire_request_bytes": len(pickle.dumps(wire, protocol=pickle.HIGHEST_PROTOCOL)),
               "scheduler_request_us": round_trip_us(scheduler, False, args.rounds),
               "wire_request_us": round_trip_us(wire, True, args.rounds)}
        rows.append(row)
        print(f"prompt {n:5d} tokens: {row['scheduler_request_bytes']:6d} -> {row['wire_request_bytes']:6d} bytes; "
              f"encode + decode {row['scheduler_request_us']:6.1f} -> {row['wire_request_us']:6.1f} us "
              "(the wire type's includes building the engine's Request)")
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
