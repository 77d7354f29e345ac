"""The per-request path choice end to end (the router's default `--path-policy slo`), on a live
prefill worker and decode worker: while the decode worker streams, a long prompt goes through the
pair (computing it there would stall that stream past its TPOT SLO) and a short one runs whole on the
decode worker (a transfer would gain nothing); every output equals the offline engine's."""

from __future__ import annotations

import threading
import time

import pytest
from cluster_utils import metric_or_zero, run_all, wait_blocks_free
from server_utils import running_server, web

from tandem import SamplingParams

pytestmark = pytest.mark.slow

MIXED = ("--dtype", "float32", "--kv-cache-memory", "0.25", "--max-num-batched-tokens", "256",
         "--prefill-workers", "1", "--decode-workers", "1",
         "--slo-ttft-ms", "20000", "--slo-tpot-ms", "150")


def decoding(server_url: str) -> int:
    workers = web.get(f"{server_url}/v1/cluster", timeout=10).json()["workers"]
    return sum(w["running"] for w in workers if w["role"] == "decode")


def test_long_prompts_go_through_the_pair_and_short_ones_stay_whole(passages: list[str], llm_fp32) -> None:  # noqa: ANN001
    long = " ".join(passages)[:2400] + " In short,"
    short = "The capital of France is"
    greedy = SamplingParams(temperature=0, max_tokens=16)
    expected = {t: (o.outputs[0].text, o.outputs[0].finish_reason)
                for t, o in zip((long, short), llm_fp32.generate([long, short], greedy), strict=True)}
    with running_server(*MIXED) as s:
        paths = lambda: {p: metric_or_zero(s, "router_routed", path=p) for p in ("colocated", "disaggregated")}  # noqa: E731
        # Warm the speeds the choice reads (each worker's prefill rate, the decode step).
        assert run_all(s, [short], max_tokens=16) == [expected[short]]
        assert paths() == {"colocated": 1, "disaggregated": 0}  # idle, short: no transfer is worth it
        # A long stream keeps the decode worker decoding (it too is short, so it runs there whole);
        # the client hangs up on it at the end.
        body = {"prompt": "Tell me a long story about a dragon.", "max_tokens": 2000, "temperature": 0,
                "ignore_eos": True, "stream": True}
        done = threading.Event()

        def listen() -> None:
            with web.stream("POST", f"{s.url}/v1/completions", json=body, timeout=300) as r:
                for _ in r.iter_lines():
                    if done.is_set():
                        return

        stream = threading.Thread(target=listen)
        stream.start()
        deadline = time.monotonic() + 60
        while decoding(s.url) < 1:
            assert time.monotonic() < deadline, "the stream did not start decoding"
            time.sleep(0.1)
        time.sleep(1.0)  # a report or two with it decoding
        before = paths()
        assert run_all(s, [long], max_tokens=16) == [expected[long]]
        after = paths()
        assert after["disaggregated"] - before["disaggregated"] == 1  # the prefill worker took the prompt
        assert run_all(s, [short], max_tokens=16) == [expected[short]]
        assert paths()["colocated"] - after["colocated"] == 1  # whole on the decode worker, stream or not
        assert decoding(s.url) >= 1  # the stream was decoding throughout
        done.set()
        stream.join(60)
        wait_blocks_free(s)  # the stream the client left is freed too
