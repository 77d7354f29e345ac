"""Overload and tenant flood against one `tandem serve`, in one run.

  .venv/bin/python bench/hostile_traffic.py [--phase-seconds 25] [--max-num-seqs 8] [--out DIR]

Phases, each a closed loop of clients for --phase-seconds on the same server:
  light     2 clients of short completions: the TTFT a request gets when the server is not busy;
  overload  10x the engine's seats in clients that resend at once after a 429: admitted requests'
            TTFT against light load, the share refused, that every 429 carries Retry-After, no 5xx;
  alone     tenant B's short chats (2 clients);
  flood     the same chats while tenant A floods long prompts: B's TTFT p99 against alone;
  capacity  clients = seats of one tenant, then of two tenants, with admission and fairness on, and
            the same on a server started with both off (--no-guards run): throughput at 1x load.
The admission settings are the ones an operator keeping a TTFT SLO would use: --seat-overcommit 1
and --admission-ttft-budget. Writes results.json, summary.md and a plot to --out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np
from rich.console import Console
from rich.progress import Progress
from server_process import free_port, stop_server, tandem_exe, wait_healthy

from tandem.bench.client import EndpointConfig, RequestRecord, send_request
from tandem.bench.workloads import TextMaker
from tandem.model.loader import load_tokenizer

console = Console(stderr=True)
KEYS = {"A": "tenant-a-key", "B": "tenant-b-key"}


@dataclass
class Phase:
    name: str
    records: list[RequestRecord] = field(default_factory=list)
    seconds: float = 0.0

    def admitted(self, tenant: str | None = None) -> list[RequestRecord]:
        return [r for r in self.records if r.success and (tenant is None or r.category == tenant)]

    def ttft(self, q: float, tenant: str | None = None) -> float | None:
        values = [r.ttft for r in self.admitted(tenant)]
        return float(np.percentile(values, q)) * 1000 if values else None

    def summary(self) -> dict:
        statuses: dict[str, int] = {}
        for r in self.records:
            statuses[str(r.status)] = statuses.get(str(r.status), 0) + 1
        refused = [r for r in self.records if r.status == 429]
        out_tokens = sum(r.output_tokens for r in self.admitted())
        return {"requests": len(self.records), "admitted": len(self.admitted()), "statuses": statuses,
                "refused_without_retry_after": sum(1 for r in refused if not r.retry_after),
                "server_errors": sum(1 for r in self.records if r.status >= 500),
                "other_failures": sum(1 for r in self.records if r.status == 200 and not r.success),
                "ttft_p50_ms": self.ttft(50), "ttft_p99_ms": self.ttft(99),
                "output_tok_s": out_tokens / self.seconds if self.seconds else 0.0}


async def client(http: httpx.AsyncClient, base: str, tenant: str, prompts: list[str], out_len: int, until: float,
                 phase: Phase, origin: float, resend_s: float) -> None:
    cfg = EndpointConfig(base, api_key=KEYS[tenant], ignore_eos=True)
    i = 0
    while time.perf_counter() < until:
        prompt = prompts[i % len(prompts)]
        i += 1
        record = RequestRecord(len(phase.records), 0, 0, tenant, 0, out_len)
        await send_request(http, cfg, prompt, record, origin, lambda t: 1)
        phase.records.append(record)
        if record.status == 429:
            await asyncio.sleep(resend_s)  # a hostile client: it does not wait for Retry-After


async def run_phase(base: str, name: str, groups: list[tuple[str, int, list[str], int]], seconds: float,
                    resend_s: float = 0.05) -> Phase:
    """groups: (tenant, clients, prompts, output tokens)."""
    phase = Phase(name)
    limits = httpx.Limits(max_connections=512, max_keepalive_connections=512)
    async with httpx.AsyncClient(timeout=httpx.Timeout(120.0), limits=limits) as http:
        origin = time.perf_counter()
        until = origin + seconds
        tasks = [client(http, base, tenant, prompts, out_len, until, phase, origin, resend_s)
                 for tenant, n, prompts, out_len in groups for _ in range(n)]
        await asyncio.gather(*tasks)
        phase.seconds = time.perf_counter() - origin
    s = phase.summary()
    console.print(f"  {name}: {s['admitted']}/{s['requests']} admitted, TTFT p50 {s['ttft_p50_ms'] or 0:.0f} ms "
                  f"p99 {s['ttft_p99_ms'] or 0:.0f} ms, {s['output_tok_s']:.1f} out tok/s, statuses {s['statuses']}")
    return phase


def start_server(args: argparse.Namespace, guards: bool, log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [tandem_exe(), "serve", "--host", "127.0.0.1", "--port", str(port), "--kv-cache-memory", "1",
           "--max-num-seqs", str(args.max_num_seqs), "--max-num-batched-tokens", str(args.max_num_batched_tokens),
           "--api-key", KEYS["A"], "--api-key", KEYS["B"]]
    if guards:
        cmd += ["--seat-overcommit", "1", "--admission-ttft-budget", str(args.ttft_budget)]
    else:
        cmd += ["--seat-overcommit", "1000", "--admission-ttft-budget", "0", "--max-waiting-requests", "100000"]
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    with Progress(console=console, transient=True) as progress:
        wait_healthy(proc, url, 600, log, progress, "server")
    return proc, url


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


async def measure(args: argparse.Namespace, base: str, maker: TextMaker) -> dict[str, Phase]:
    rng = np.random.default_rng(0)
    short = [maker.text(rng, 128) for _ in range(32)]
    chats = [maker.text(rng, 64) for _ in range(32)]
    long = [maker.text(rng, args.flood_prompt_tokens) for _ in range(16)]
    seats, t = args.max_num_seqs, args.phase_seconds
    await run_phase(base, "warm-up", [("A", 2, short, 16)], 5)
    phases = {
        "light": await run_phase(base, "light", [("A", 2, short, 32)], t),
        "overload": await run_phase(base, "overload", [("A", 10 * seats, short, 32)], t),
        "alone": await run_phase(base, "alone", [("B", 2, chats, 16)], t),
        "flood": await run_phase(base, "flood", [("A", args.flood_clients, long, 8), ("B", 2, chats, 16)], t),
        "capacity": await run_phase(base, "capacity", [("A", seats // 2, short, 64), ("B", seats // 2, short, 64)],
                                    t),
    }
    return phases


async def measure_unguarded(args: argparse.Namespace, base: str, maker: TextMaker) -> Phase:
    rng = np.random.default_rng(0)
    short = [maker.text(rng, 128) for _ in range(32)]
    await run_phase(base, "warm-up", [("A", 2, short, 16)], 5)
    return await run_phase(base, "capacity (guards off)", [("A", args.max_num_seqs, short, 64)], args.phase_seconds)


def plot(phases: dict[str, Phase], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, names, tenant, title in ((axes[0], ("light", "overload"), None, "Admitted TTFT: light vs 10x overload"),
                                     (axes[1], ("alone", "flood"), "B", "Tenant B's chats: alone vs A's flood")):
        data = [[r.ttft * 1000 for r in phases[n].admitted(tenant)] or [0.0] for n in names]
        ax.boxplot(data, whis=(1, 99), showfliers=False)
        ax.set_xticks([1, 2], names)
        ax.set_ylabel("TTFT (ms), whiskers p1-p99")
        ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--phase-seconds", type=float, default=25.0)
    ap.add_argument("--max-num-seqs", type=int, default=8)
    ap.add_argument("--max-num-batched-tokens", type=int, default=256)
    ap.add_argument("--ttft-budget", type=float, default=1.0, help="the server's --admission-ttft-budget")
    ap.add_argument("--flood-clients", type=int, default=6)
    ap.add_argument("--flood-prompt-tokens", type=int, default=1500)
    ap.add_argument("--out", type=Path, default=Path("bench/results/hostile_traffic"))
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    maker = TextMaker(load_tokenizer(None))
    results: dict = {"settings": {k: str(v) for k, v in vars(args).items()}}
    console.print("[bold]server with admission control and fair scheduling[/]")
    proc, base = start_server(args, True, args.out / "server.log")
    try:
        phases = asyncio.run(measure(args, base, maker))
    finally:
        stop_server(proc)
    console.print("[bold]server with both off (the 1x-load throughput reference)[/]")
    proc, base = start_server(args, False, args.out / "server_unguarded.log")
    try:
        unguarded = asyncio.run(measure_unguarded(args, base, maker))
    finally:
        stop_server(proc)
    results["phases"] = {name: p.summary() for name, p in phases.items()} | {"capacity_unguarded": unguarded.summary()}
    b_alone, b_flood = phases["alone"].ttft(99, "B"), phases["flood"].ttft(99, "B")
    results["ratios"] = {
        "overload_ttft_p50_vs_light": ratio(phases["overload"].ttft(50), phases["light"].ttft(50)),
        "overload_ttft_p99_vs_light": ratio(phases["overload"].ttft(99), phases["light"].ttft(99)),
        "flood_b_ttft_p99_vs_alone": ratio(b_flood, b_alone),
        "capacity_throughput_guarded_vs_off": ratio(phases["capacity"].summary()["output_tok_s"],
                                                    unguarded.summary()["output_tok_s"]),
        "server_errors": sum(p.summary()["server_errors"] for p in [*phases.values(), unguarded]),
    }
    (args.out / "results.json").write_text(json.dumps(results, indent=2))
    plot(phases, args.out / "hostile_traffic.png")
    lines = ["| measure | value | goal |", "|---|---:|---|"]
    goals = {"overload_ttft_p50_vs_light": "<= 3", "overload_ttft_p99_vs_light": "<= 3",
             "flood_b_ttft_p99_vs_alone": "<= 3", "capacity_throughput_guarded_vs_off": ">= 0.97", "server_errors": "0"}
    for key, value in results["ratios"].items():
        lines.append(f"| {key} | {value:.2f} | {goals[key]} |" if isinstance(value, float)
                     else f"| {key} | {value} | {goals[key]} |")
    (args.out / "summary.md").write_text("\n".join(lines) + "\n")
    console.print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
