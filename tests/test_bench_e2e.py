"""`tandem bench serve` against a real `tandem serve`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from server_utils import running_server

from tandem.cli import main


@pytest.mark.slow
def test_bench_serve_against_tandem(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with running_server("--kv-cache-memory", "0.5", "--max-num-batched-tokens", "256") as server:
        common = ["--base-url", server.url, "--disable-tqdm", "--save-result", "--result-dir", str(tmp_path),
                  "--ignore-eos", "--random-input-len", "32", "--random-output-len", "8"]
        assert main(["bench", "serve", *common, "--num-prompts", "8", "--result-filename", "cmpl.json",
                     "--goodput", "ttft:60000", "--num-warmups", "1"]) == 0
        assert main(["bench", "serve", *common, "--backend", "openai-chat", "--num-prompts", "4",
                     "--max-concurrency", "2", "--result-filename", "chat.json"]) == 0
    out = capsys.readouterr().out
    assert "Serving Benchmark Result" in out

    r = json.loads((tmp_path / "cmpl.json").read_text())
    assert r["completed"] == 8 and r["failed"] == 0
    assert r["model_id"] and r["endpoint"] == "/v1/completions"
    # The prompts were built as 32 tokens of the server's own tokenizer; ignore_eos makes 8 outputs each.
    assert r["total_input_tokens"] == 8 * 32 and r["total_output_tokens"] == 8 * 8
    assert r["request_throughput"] > 0 and r["output_throughput"] > 0 and r["total_token_throughput"] > 0
    assert 0 < r["mean_ttft_ms"] <= r["p99_ttft_ms"] and r["mean_tpot_ms"] > 0 and r["mean_itl_ms"] > 0
    assert r["mean_e2el_ms"] > r["mean_ttft_ms"]
    assert r["request_goodput"] == pytest.approx(r["request_throughput"])  # a 60 s TTFT SLO: all meet it

    c = json.loads((tmp_path / "chat.json").read_text())
    assert c["completed"] == 4 and c["total_output_tokens"] == 4 * 8 and c["max_concurrent_requests"] <= 2
    assert c["mean_ttft_ms"] > 0
