"""What `tandem serve` says while it starts, in JSON lines (`--log-format json`), and the start-up
errors that name the flag or file to fix, before any loading."""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
import time

import pytest
import torch
from server_utils import children, cmdline, free_port, torch_mapped, web

from tandem.cli import build_parser
from tandem.logs import JsonFormatter

SMALL = ("--dtype", "float32", "--kv-cache-memory", "0.25")


def serve(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "tandem.cli", "serve", *args], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)


def test_json_log_lines_carry_the_event_fields() -> None:
    record = logging.LogRecord("tandem.startup", logging.INFO, __file__, 1, "worker %s joined", ("decode-0",), None)
    record.event, record.role = "worker_joined", "decode"
    line = json.loads(JsonFormatter("router").format(record))
    assert line["msg"] == "worker decode-0 joined" and line["level"] == "info" and line["process"] == "router"
    assert (line["event"], line["role"]) == ("worker_joined", "decode")
    assert line["ts"].endswith("+00:00")


def test_serve_reports_its_progress_and_where_it_serves() -> None:
    port = free_port()
    proc = serve("--port", str(port), "--log-format", "json", *SMALL)
    lines: list[dict] = []
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            raw = proc.stderr.readline()
            if not raw:
                break
            lines.append(json.loads(raw))  # every line is one JSON object, the child processes' too
            # The worker says it is ready about when the API says it serves: two processes, either first.
            if any(line.get("event") == "serving" for line in lines) and \
                    any(line["msg"].startswith("colocated worker colocated-0 ready") for line in lines):
                break
        serving = [line for line in lines if line.get("event") == "serving"]
        assert serving, lines
        messages = [line["msg"] for line in lines]
        processes = {line["process"] for line in lines}
        assert {"api", "colocated-0"} <= processes
        assert any(m.startswith("loading ") for m in messages)
        assert any(m.startswith("kernels: ") for m in messages)
        assert any(m.startswith("KV pool: 0.25 GiB = ") for m in messages)
        assert any(m.startswith("colocated worker colocated-0 ready") for m in messages)
        urls = serving[0]["urls"]
        assert urls["dashboard"] == f"http://127.0.0.1:{port}/dashboard"
        assert "Ctrl-C" in serving[0]["msg"]
        # Announced only once it answers.
        assert web.get(urls["health"], timeout=5).status_code == 200
        # The API process serves without torch (the engine core alone computes): after requests that
        # tokenize, render a chat template, check a grammar and detokenize, none of torch's libraries is
        # mapped into it, while the core's are.
        chat = f"http://127.0.0.1:{port}/v1/chat/completions"
        for extra in ({"logprobs": True, "top_logprobs": 2}, {"response_format": {"type": "json_object"}}):
            body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, **extra}
            assert web.post(chat, json=body, timeout=60).status_code == 200
        assert not torch_mapped(proc.pid)
        assert [pid for pid in children(proc.pid) if torch_mapped(pid)]
        # The tree docs/architecture.md draws: the API process (the router in it) and one colocated worker
        # on every core, with no process of the worker's own (no worker group's followers without -tp).
        kids = {pid: cmdline(pid) for pid in children(proc.pid)}
        assert len(kids) == 1, kids
        [(worker, line)] = kids.items()
        assert b"\x00worker\x00" in line and b"--role\x00colocated" in line
        cores = ",".join(map(str, sorted(os.sched_getaffinity(0)))).encode()
        assert b"--cores\x00" + cores in line
        assert torch_mapped(worker) and children(worker) == []
    finally:
        proc.terminate()
        proc.wait(60)


def test_startup_errors_name_what_to_fix() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        t0 = time.monotonic()
        proc = serve("--port", str(port), *SMALL)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 2 and "--port" in err and f"port {port}" in err, err
        assert time.monotonic() - t0 < 30  # refused before a model load, not after

    # The rest fail before anything starts: checked in this process, through the same command line.
    threads = torch.get_num_threads()
    try:
        for args, says in ((("/nonexistent/model.gguf", *SMALL), ("/nonexistent/model.gguf", "MODEL")),
                           (("--kv-cache-memory", "100000"), ("--kv-cache-memory 100000", "available")),
                           (("--prefill-workers", "1", "--decode-workers", "1", "--worker-cores", "0", "4096", *SMALL),
                            ("--worker-cores", "4096")),
                           (("--speculative-config", "{bad", *SMALL), ("--speculative-config",))):
            parsed = build_parser().parse_args(["serve", "--port", str(free_port()), *args])
            with pytest.raises(ValueError) as refused:
                parsed.func(parsed)
            assert all(s in str(refused.value) for s in says), (args, refused.value)
    finally:
        torch.set_num_threads(threads)  # `serve` sets this process's torch to one thread before it loads


def test_an_engine_reads_the_tokenizers_end_token_without_loading_it() -> None:
    """An engine process needs only the eos id of the tokenizer at start (its grammars load the rest
    on first use): read from the tokenizer's files (a GGUF file's once converted), it is the id the
    tokenizer loaded whole gives, for the default model's GGUF tokenizer and a Hugging Face
    directory's."""
    from tiny_served_model import tiny_served_model

    from tandem.tokenizer import eos_token_id, load_tokenizer

    models = [None, str(tiny_served_model())]
    whole = [load_tokenizer(m).eos_token_id for m in models]  # a GGUF file's tokenizer converts on first load
    code = (f"import sys; from tandem.tokenizer import eos_token_id; print(*[eos_token_id(m) for m in {models!r}]); "
            "print('transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    *light, imported = out.stdout.split()
    assert imported == "False", out.stderr
    assert [int(e) for e in light] == whole == [eos_token_id(m) for m in models]


def test_the_command_line_parses_without_torch_so_the_core_starts_first() -> None:
    """`tandem serve` starts its worker before its own process imports torch (the two imports then run
    side by side): parsing the command line, and the launcher, must not bring torch in."""
    code = ("import sys; import tandem.cli, tandem.cli.cluster, tandem.disagg.fleet.local_launcher; "
            "tandem.cli.build_parser().parse_args(['serve', '--max-num-seqs', '8']); "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "False", out.stderr


def test_a_process_leaving_with_exit_now_still_runs_its_exit_handlers(tmp_path) -> None:  # noqa: ANN001
    """Servers, workers and cores leave with exit_now (no interpreter teardown): what a normal exit does for
    them still happens. atexit handlers run, a temporary directory's finalizer removes it, buffered
    stdout and log lines are written, and the code is the process's exit status."""
    code = ("import atexit, logging, sys, tempfile; from tandem.process_exit import exit_now; "
            f"d = tempfile.TemporaryDirectory(dir={str(tmp_path)!r}); "
            "atexit.register(lambda: print('handler ran', end=' ')); "
            "logging.basicConfig(stream=sys.stderr); logging.getLogger('t').warning('logged'); "
            "print('buffered', end=' '); exit_now(3)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 3
    assert out.stdout.split() == ["buffered", "handler", "ran"] and "logged" in out.stderr
    assert list(tmp_path.iterdir()) == []
