"""The client and the load loop against a scripted stub server whose delays are known."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path

import pytest
from bench_stub_server import MODEL, StubServer, WordTokenizer, stub_server
from server_utils import web

from tandem.bench import serve as bench_serve
from tandem.bench.client import EndpointConfig, RequestRecord
from tandem.bench.metrics import compute_metrics, metric_values
from tandem.bench.report import load_records
from tandem.bench.runner import RunConfig, RunResult, run
from tandem.bench.workloads import SampleRequest, Session
from tandem.cli import main

TOK = WordTokenizer()
# What loopback, HTTP parsing and two event loops add on a loaded two-core machine: a request's
# first chunk comes 10-20 ms after the script says (never before), gaps between chunks stay within a
# few ms. The SLOs below sit much further than that from every scripted value.
SLACK = 0.06
GAP_SLACK = 0.025


def count(text: str) -> int:
    return len(TOK.encode(text))


@pytest.fixture(scope="module")
def stub() -> Iterator[StubServer]:
    with stub_server() as s:
        # The first request through a fresh server and client pays one-off costs: keep it out of the timings.
        web.post(f"{s.url}/v1/completions", json={"prompt": "n=1"}, timeout=10).raise_for_status()
        yield s


def single(*scripts: str, max_tokens: int = 16) -> list[Session]:
    return [Session([SampleRequest(s, 10, max_tokens)]) for s in scripts]


def go(stub: StubServer, sessions: list[Session], endpoint: str = "/v1/completions", **kw: object) -> RunResult:
    cfg = RunConfig(EndpointConfig(stub.url, endpoint, MODEL), progress=False, **kw)  # type: ignore[arg-type]
    return run(cfg, sessions, count)


SCRIPTS = ["ttft=0.10 itl=0.02 n=5",      # ttft 100, itl 4 x 20, e2e 180, tpot 20
           "ttft=0.30 itl=0.05 n=3",      # ttft 300, itl 2 x 50, e2e 400, tpot 50
           "ttft=0.05 n=1",               # ttft 50, e2e 50, no itl, no tpot
           "ttft=0.05 itl=0.02,0.2 n=3",  # ttft 50, itl 20 and 200, e2e 270, tpot 110
           "status=500"]
EXPECTED = [(0.10, [0.02] * 4, 0.18, 0.02), (0.30, [0.05] * 2, 0.40, 0.05), (0.05, [], 0.05, None),
            (0.05, [0.02, 0.2], 0.27, 0.11)]


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
def test_timings_match_the_script(stub: StubServer, endpoint: str) -> None:
    result = go(stub, single(*SCRIPTS), endpoint)
    recs = result.records
    assert [r.success for r in recs] == [True, True, True, True, False]
    assert recs[4].error.startswith("HTTP 500")
    for r, (ttft, itl, e2e, tpot) in zip(recs, EXPECTED, strict=False):
        # The stub starts its clock after the request reached it, so measurements are never early.
        assert ttft - 0.002 <= r.ttft <= ttft + SLACK
        assert len(r.itl) == len(itl) and all(abs(a - b) < GAP_SLACK for a, b in zip(r.itl, itl, strict=True))
        assert r.latency == pytest.approx(r.ttft + sum(r.itl))
        assert e2e - 0.002 <= r.latency <= e2e + SLACK
        assert r.output_tokens == len(itl) + 1
        if tpot is None:
            assert r.tpot is None
        else:
            assert r.tpot == (r.latency - r.ttft) / (r.output_tokens - 1)
            assert abs(r.tpot - tpot) < GAP_SLACK
    assert result.duration >= max(r.start + r.latency for r in recs[:4])

    m = compute_metrics(recs, result.duration, [50, 99], goodput={"ttft": 200, "tpot": 80, "e2el": 390})
    # Goodput: #1 misses TTFT and e2el, #3 misses TPOT; #0 and the one-token #2 meet every SLO.
    assert m["completed"] == 4 and m["failed"] == 1
    assert m["request_goodput"] == 2 / result.duration
    assert m["request_throughput"] == 4 / result.duration
    assert m["total_output_tokens"] == 12 and m["output_throughput"] == 12 / result.duration
    # The metrics are exactly the arithmetic of the measured records.
    ok = recs[:4]
    assert m["mean_ttft_ms"] == pytest.approx(sum(r.ttft for r in ok) / 4 * 1000)
    tpots = [r.tpot for r in ok if r.tpot is not None]
    assert m["mean_tpot_ms"] == pytest.approx(sum(tpots) / 3 * 1000)
    assert metric_values(ok, "itl") == [g for r in ok for g in r.itl]
    assert m["mean_itl_ms"] == pytest.approx(sum(metric_values(ok, "itl")) / 8 * 1000)
    assert abs(m["mean_e2el_ms"] - (180 + 400 + 50 + 270) / 4) < SLACK * 1000
    assert abs(m["p50_itl_ms"] - 20) < GAP_SLACK * 1000


def test_output_tokens_from_usage_or_tokenizer(stub: StubServer) -> None:
    recs = go(stub, single("n=4 tpc=2", "n=4 tpc=2 usage=0", "n=4 reported=9")).records
    assert [r.output_tokens for r in recs] == [8, 8, 9]  # usage wins over counting the text
    assert recs[1].generated_text == " tok tok" * 4


def test_failures_are_counted_not_raised(stub: StubServer) -> None:
    recs = go(stub, single("n=5 fail=2", "n=0", "status=429", "n=2")).records
    assert [r.success for r in recs] == [False, False, False, True]
    assert "scripted stream error" in recs[0].error and "no content" in recs[1].error and "429" in recs[2].error
    closed = RunConfig(EndpointConfig("http://127.0.0.1:9", "/v1/completions", MODEL), progress=False)
    dead = run(closed, single("n=1"), count).records[0]
    assert not dead.success and "ConnectError" in dead.error


def test_request_body(stub: StubServer) -> None:
    stub.bodies.clear()
    cfg = RunConfig(EndpointConfig(stub.url, "/v1/chat/completions", MODEL, ignore_eos=True,
                                   extra_body={"top_k": 5}), progress=False)
    run(cfg, single("n=1", max_tokens=7), count)
    body = stub.bodies[0]
    assert body["model"] == MODEL and body["stream"] and body["stream_options"] == {"include_usage": True}
    assert body["max_tokens"] == body["max_completion_tokens"] == 7
    assert body["ignore_eos"] is True and body["top_k"] == 5 and body["temperature"] == 0.0
    assert body["messages"] == [{"role": "user", "content": "n=1"}]


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
def test_multi_turn_history_grows_with_replies(stub: StubServer, endpoint: str) -> None:
    stub.bodies.clear()
    # Workload prompts start with a space, so the completions history reads as words (the stub's
    # script is the last n= in it).
    turns = [SampleRequest(" n=2", 3, 2, "turn1"), SampleRequest(" n=3", 4, 3, "turn2"),
             SampleRequest(" n=1", 5, 1, "turn3")]
    recs = go(stub, [Session(turns)], endpoint).records
    assert [r.turn for r in recs] == [0, 1, 2] and all(r.success for r in recs)
    # Prompt tokens: each turn's own plus the whole history (earlier prompts and replies).
    assert [r.prompt_len for r in recs] == [3, 3 + 2 + 4, 3 + 2 + 4 + 3 + 5]
    # Each turn starts after the previous one ended.
    assert all(b.start >= a.start + a.latency for a, b in zip(recs, recs[1:], strict=False))
    last = stub.bodies[-1]
    if endpoint.endswith("chat/completions"):
        assert last["messages"] == [{"role": "user", "content": " n=2"}, {"role": "assistant", "content": " tok tok"},
                                    {"role": "user", "content": " n=3"},
                                    {"role": "assistant", "content": " tok tok tok"},
                                    {"role": "user", "content": " n=1"}]
    else:
        assert last["prompt"] == " n=2 tok tok n=3 tok tok tok n=1"


def test_failed_turn_ends_the_conversation(stub: StubServer) -> None:
    turns = [SampleRequest("status=500", 3, 2), SampleRequest("n=1", 3, 1)]
    recs = go(stub, [Session(turns)]).records
    assert [r.success for r in recs] == [False, False] and "earlier turn" in recs[1].error


def test_max_concurrency_and_rate(stub: StubServer) -> None:
    result = go(stub, single(*["ttft=0.05 n=1"] * 8), max_concurrency=2)
    m = compute_metrics(result.records, result.duration)
    assert m["max_concurrent_requests"] == 2 and m["completed"] == 8
    assert result.duration >= 4 * 0.05  # four waves of two
    paced = go(stub, single(*["n=1"] * 5), request_rate=20.0, burstiness=1e6)  # near-regular gaps of 50 ms
    starts = [r.start for r in paced.records]
    assert all(abs((b - a) - 0.05) < GAP_SLACK for a, b in zip(starts, starts[1:], strict=False))


def test_trace_timestamps_drive_arrivals(stub: StubServer) -> None:
    sessions = [Session([SampleRequest("n=1", 1, 1)], timestamp=t) for t in (0.0, 0.2, 0.3)]
    starts = [r.start for r in go(stub, sessions, request_rate=math.inf).records]
    assert all(abs(s - t) < SLACK for s, t in zip(starts, (0.0, 0.2, 0.3), strict=True))


# -- the commands ---------------------------------------------------------------------------------

@pytest.fixture
def word_tokenizer(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(bench_serve, "load_bench_tokenizer", lambda path: TOK)


def test_serve_command_writes_result_records_and_plots(stub: StubServer, tmp_path: Path, word_tokenizer: None,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["bench", "serve", "--base-url", stub.url, "--num-prompts", "6", "--random-input-len", "8",
               "--random-output-len", "4", "--ignore-eos", "--goodput", "ttft:1000", "--num-warmups", "2",
               "--save-result", "--save-detailed", "--result-dir", str(tmp_path), "--result-filename", "r.json",
               "--label", "stub", "--metadata", "gpu=none", "--plot", "--disable-tqdm"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "Serving Benchmark Result" in out and "Mean TTFT (ms):" in out and "P99 ITL (ms):" in out
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["completed"] == 6 and result["failed"] == 0 and result["model_id"] == MODEL
    assert result["label"] == "stub" and result["gpu"] == "none" and result["request_rate"] == "inf"
    assert result["total_input_tokens"] == 48 and result["total_output_tokens"] == 24
    assert result["request_goodput"] == pytest.approx(result["request_throughput"])
    for key in ("duration", "request_throughput", "output_throughput", "total_token_throughput", "mean_ttft_ms",
                "median_ttft_ms", "p99_ttft_ms", "p90_tpot_ms", "p99_itl_ms", "mean_e2el_ms", "ttfts", "itls"):
        assert key in result
    records = load_records(tmp_path / "r.requests.jsonl")
    assert len(records) == 6 and all(isinstance(r, RequestRecord) and r.success for r in records)
    for name in ("latency_cdf", "itl_over_time", "throughput"):
        assert (tmp_path / f"r.{name}.png").read_bytes()[:4] == b"\x89PNG"


def test_sweep_and_compare(stub: StubServer, tmp_path: Path, word_tokenizer: None,
                           capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(["bench", "sweep", "--base-url", stub.url, "--request-rates", "50,100,inf", "--num-prompts", "4",
               "--random-input-len", "4", "--random-output-len", "2", "--goodput", "ttft:1000", "--save-result",
               "--result-dir", str(tmp_path), "--result-filename", "sw.json", "--disable-tqdm"])
    assert rc == 0
    summary = json.loads((tmp_path / "sw.json").read_text())
    assert [r["request_rate"] for r in summary["runs"]] == [50.0, 100.0, "inf"]
    assert all(r["completed"] == 4 and r["request_goodput"] is not None for r in summary["runs"])
    assert (tmp_path / "sw.png").read_bytes()[:4] == b"\x89PNG"
    assert (tmp_path / "sw-rate50.json").exists() and (tmp_path / "sw-rateinf.json").exists()
    capsys.readouterr()

    a, b = tmp_path / "a.json", tmp_path / "b.json"
    base = json.loads((tmp_path / "sw-rate50.json").read_text())
    a.write_text(json.dumps(base | {"label": "A", "output_throughput": 100.0, "mean_ttft_ms": 20.0}))
    b.write_text(json.dumps(base | {"label": "B", "output_throughput": 150.0, "mean_ttft_ms": 10.0}))
    assert main(["bench", "compare", str(a), str(b)]) == 0
    table = capsys.readouterr().out
    lines = {line.split()[0]: line.split() for line in table.splitlines() if line.strip()}
    assert lines["metric"] == ["metric", "A", "B", "B/A"]
    assert lines["output_throughput"] == ["output_throughput", "100.00", "150.00", "1.50x"]
    assert lines["mean_ttft_ms"] == ["mean_ttft_ms", "20.00", "10.00", "0.50x"]
    assert main(["bench", "compare", str(a), str(b), "--fields", "completed"]) == 0
    assert "mean_ttft_ms" not in capsys.readouterr().out


def test_bad_flags_are_errors(stub: StubServer, word_tokenizer: None) -> None:
    base = ["bench", "serve", "--base-url", stub.url, "--num-prompts", "1", "--disable-tqdm"]
    assert main([*base, "--goodput", "ttft=5"]) == 2
    assert main([*base, "--percentile-metrics", "ttft,bogus"]) == 2
    assert main([*base, "--dataset-name", "mooncake_trace"]) == 2  # no --dataset-path
    assert main(["bench", "serve", "--base-url", "http://127.0.0.1:9", "--disable-tqdm"]) == 2  # no /v1/models


def test_think_time_spaces_the_turns_as_seeded(stub: StubServer) -> None:
    turns = [SampleRequest(f" n={n}", 3, n) for n in (1, 1, 1, 1)]

    def gaps(**kw: object) -> list[float]:
        recs = go(stub, [Session(list(turns))], "/v1/chat/completions", **kw).records
        assert all(r.success for r in recs)
        return [b.start - (a.start + a.latency) for a, b in zip(recs, recs[1:], strict=False)]

    thinking = gaps(think_time_s=0.15, seed=3)
    assert sum(thinking) > 0.15  # three exponential gaps of mean 0.15 s: well above zero
    again = gaps(think_time_s=0.15, seed=3)
    assert all(abs(a - b) < 0.05 for a, b in zip(thinking, again, strict=True))  # the same draws
    assert sum(gaps()) < sum(thinking) / 3  # without: each turn goes at once
