"""Tandem (weights as stored, with an int8 KV cache, and dequantized) against llama.cpp's llama-server
on the same GGUF file and the same cores, one server at a time, each under the same `tandem bench
serve` workloads:

    one stream     256 in / 128 out, concurrency 1
    c8, c32        256 in / 128 out, concurrency 8 and 32
    long           2,048 in / 64 out, concurrency 16
    prompt-2k      2,048 in / 16 out, concurrency 1 (a long prompt's TTFT)

    .venv/bin/python benchmarks/vs_llama_cpp.py --llama-server /work/llama/bin/llama-server

llama.cpp is not a dependency: its source ships in the PyPI source distribution of llama-cpp-python
(`pip download --no-deps --no-binary :all: llama-cpp-python`; `cmake -B build -DGGML_NATIVE=ON
-DLLAMA_CURL=OFF -DLLAMA_USE_PREBUILT_UI=OFF && cmake --build build --target llama-server`).
Results: benchmarks/results/vs_llama_cpp/<server>-<workload>.json and a summary table (summary.json).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
from rich.console import Console
from rich.progress import Progress
from rich.table import Table
from server_process import RunFailed, free_port, stop_server, tandem_exe, wait_healthy

from tandem.model_path import default_model_path

console = Console(stderr=True)
ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Workload:
    name: str
    input_len: int
    output_len: int
    concurrency: int
    prompts: int


WORKLOADS = [Workload("one-stream", 256, 128, 1, 4), Workload("c8", 256, 128, 8, 16),
             Workload("c32", 256, 128, 32, 64), Workload("long", 2048, 64, 16, 16),
             Workload("prompt-2k", 2048, 16, 1, 2)]
SLOTS = 32  # llama-server's parallel sequences: the largest concurrency
TANDEM_SERVERS = {  # name -> its `tandem serve` flags
    "tandem-auto": [],  # what a user gets: --quantization auto (by the CPU and the model's size)
    "tandem": ["--quantization", "gguf"],  # the file's blocks as stored (the default where bf16 is not native)
    # The blocks as stored with int8 activations (llama.cpp's arithmetic; K-quants per 256).
    "tandem-q8": ["--quantization", "gguf-q8"],
    "tandem-int8kv": ["--quantization", "gguf", "--kv-cache-dtype", "int8"],
    "tandem-dense": ["--quantization", "none"],  # dequantized to --dtype auto (bf16 where native: the default)
}
SLOT_CONTEXT = 2304  # the longest request (2,048 + 64) and then some


def server_command(name: str, port: int, args: argparse.Namespace) -> list[str]:
    """Tandem with its shipped admission (queue), which serves these loads whole as llama-server does."""
    model = str(args.model or default_model_path())
    if name == "llama.cpp":
        return [args.llama_server, "-m", model, "--host", "127.0.0.1", "--port", str(port), "-t", str(args.threads),
                "-np", str(SLOTS), "-c", str(SLOTS * SLOT_CONTEXT), "--no-webui"]
    flags = TANDEM_SERVERS[name]
    return [tandem_exe(), "--log-level", "WARNING", "serve", "--port", str(port), "--dtype", "auto", *flags,
            "--num-threads", str(args.threads), "--max-num-seqs", str(SLOTS), model,
            *shlex.split(args.tandem_args)]


def run_server(name: str, args: argparse.Namespace, progress: Progress) -> list[dict]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = server_command(name, port, args)
    log = args.out_dir / f"{name}.server.log"
    console.print(f"[bold]{name}[/]: {shlex.join(command)}")
    env = dict(os.environ)
    if name == "llama.cpp":
        env["LD_LIBRARY_PATH"] = str(Path(args.llama_server).parent)
    with log.open("w") as f:
        proc = subprocess.Popen(command, stdout=f, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    results = []
    try:
        wait_healthy(proc, url, args.startup_timeout, log, progress, name)
        model = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
        for w in WORKLOADS:
            if args.workloads and w.name not in args.workloads.split(","):
                continue
            out = args.out_dir / f"{name}-{w.name}.json"
            flags = [tandem_exe(), "bench", "serve", "--base-url", url, "--model", model, "--ignore-eos",
                     "--dataset-name", "random", "--random-input-len", str(w.input_len),
                     "--random-output-len", str(w.output_len), "--random-range-ratio", "0",
                     "--max-concurrency", str(w.concurrency), "--num-prompts", str(w.prompts),
                     "--num-warmups", "2", "--seed", str(w.concurrency), "--save-result",
                     "--result-dir", str(args.out_dir), "--result-filename", out.name, "--label", f"{name} {w.name}"]
            task = progress.add_task(f"{name} {w.name}", total=None)
            t0 = time.monotonic()
            with (args.out_dir / "client.log").open("a") as f:
                f.write(f"\n$ {shlex.join(flags)}\n")
                f.flush()
                rc = subprocess.run(flags, stdout=f, stderr=subprocess.STDOUT, check=False).returncode
            progress.remove_task(task)
            if rc != 0:
                raise RunFailed(f"{name} {w.name}: bench exited with {rc}", args.out_dir / "client.log")
            r = json.loads(out.read_text())
            if r.get("failed"):  # a throughput over fewer requests than the other server's compares nothing
                raise RunFailed(f"{name} {w.name}: {r['failed']} of {r.get('num_requests')} requests failed",
                                out.with_suffix(".requests.jsonl"))
            results.append({"server": name, "workload": w.name, "wall_s": time.monotonic() - t0,
                            **{k: r.get(k) for k in ("output_throughput", "median_ttft_ms", "median_tpot_ms",
                                                     "p99_tpot_ms", "median_itl_ms", "completed")}})
            console.print(f"  {w.name}: {r.get('output_throughput', 0):.1f} tok/s out, "
                          f"TPOT p50 {r.get('median_tpot_ms', 0):.1f} ms, TTFT p50 {r.get('median_ttft_ms', 0):.0f} ms")
    finally:
        stop_server(proc)
    return results


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-server", default="/work/llama/bin/llama-server")
    ap.add_argument("--model", type=Path, default=None, help="a GGUF file (default: the default model); "
                    "benchmarks/model_shapes.py makes Llama-3.2 1B/3B, Phi-4-mini and SmolLM3-3B shapes")
    ap.add_argument("--servers", default="tandem,tandem-int8kv,tandem-dense,llama.cpp")
    ap.add_argument("--workloads", default="", help="comma-separated subset of " + ",".join(w.name for w in WORKLOADS))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tandem-args", default="", help="extra `tandem serve` flags")
    ap.add_argument("--startup-timeout", type=float, default=300)
    ap.add_argument("--out-dir", type=Path, default=ROOT / "benchmarks/results/vs_llama_cpp")
    args = ap.parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    with Progress(console=console, transient=True) as progress:
        for name in args.servers.split(","):
            try:
                rows += run_server(name, args, progress)
            except RunFailed as e:
                console.print(f"[red]{name}: {e}[/]\n{e.detail}")
    (args.out_dir / "summary.json").write_text(json.dumps(rows, indent=1))
    table = Table("workload", "server", "out tok/s", "TPOT p50 ms", "TTFT p50 ms", "vs llama.cpp (tok/s)")
    base = {r["workload"]: r for r in rows if r["server"] == "llama.cpp"}
    for r in rows:
        b = base.get(r["workload"])
        ratio = f"{r['output_throughput'] / b['output_throughput']:.2f}x" if b and b["output_throughput"] else "-"
        table.add_row(r["workload"], r["server"], f"{r['output_throughput']:.1f}", f"{r['median_tpot_ms']:.1f}",
                      f"{r['median_ttft_ms']:.0f}", ratio)
    console.print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
