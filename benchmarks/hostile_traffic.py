"""Overload and a tenant flood against `tandem serve` with its defaults (admission `queue`), against the
same server with `--admission off` and with `--admission slo`, in one run.

  .venv/bin/python benchmarks/hostile_traffic.py [--phase-seconds 20] [--out DIR] [-- SERVER FLAGS]

Every server gets the defaults (only a 1 GiB pool and two API keys, tenants A and B); requests are
fresh prompts of --prompt-tokens (256) with --output-tokens (64), each sending `timeout: 30` as a
client with a deadline does. First the reference, admission off:
  light     1 client: the TTFT of a request on an idle server;
  capacity  --capacity-clients (max-num-seqs, 128 by default) in a closed loop: the requests per second
            it completes when saturated (C);
  1x load   Poisson arrivals at C, and at 0.7 C: the throughput admission control must not cost.
Then the default server (queue), tenants A and B: light, 1x and 0.7x load (A and B at half each;
goal: none refused, >= 0.97x the reference's tokens), 10x load (arrivals at 10 C whatever the answers;
goal: no 5xx, no admitted request past its 30 s timeout, 429s with Retry-After), B alone (2 clients
of short chats) and B under A's flood of --flood-prompt-tokens (3,000) prompts at 10 C (goal: all of
B's served, TTFT p99 <= 3x alone). Last `--admission slo` with --slo-ttft-ms at 3x the reference's
light TTFT p99, at 10x load (goal: admitted TTFT p99 within that SLO).
Writes results.json, summary.md and hostile_traffic.png to --out.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import subprocess
import time
from collections import Counter
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
TIMEOUT_S = 30.0  # every request's own `timeout`


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

    def tpot_p90(self) -> float | None:
        values = [t for r in self.admitted() if (t := r.tpot) is not None]
        return float(np.percentile(values, 90)) * 1000 if values else None

    def summary(self) -> dict:
        statuses: dict[str, int] = {}
        for r in self.records:
            statuses[str(r.status)] = statuses.get(str(r.status), 0) + 1
        refused = [r for r in self.records if r.status == 429]
        admitted = self.admitted()
        reasons: dict[str, int] = {}
        for r in refused:
            try:
                reason = json.loads(r.error.split(": ", 1)[1])["error"]["message"].split(";")[0]
            except (IndexError, KeyError, ValueError):
                reason = r.error[:60]
            reason = re.sub(r"\d+(\.\d+)?", "N", reason)  # one count per rule, whatever its figures
            reasons[reason] = reasons.get(reason, 0) + 1
        out_tokens = sum(r.output_tokens for r in self.admitted())
        # Admitted (not refused) and not done within its 30 s timeout: the server's 408, a stream the
        # server ended at its timeout, or a late answer.
        timed_out = sum(1 for r in self.records if r.status != 429 and (not r.success or r.latency > TIMEOUT_S))
        return {"requests": len(self.records), "admitted": len(self.admitted()), "statuses": statuses,
                "refused": len(refused), "admitted_past_timeout": timed_out,
                "e2e_p99_s": float(np.percentile([r.latency for r in admitted], 99)) if admitted else None,
                "tpot_p90_ms": self.tpot_p90(),
                "refused_without_retry_after": sum(1 for r in refused if not r.retry_after), "refusals": reasons,
                "server_errors": sum(1 for r in self.records if r.status >= 500),
                "other_failures": sum(1 for r in self.records if r.status == 200 and not r.success),
                "failure_reasons": dict(Counter(re.sub(r"\d+(\.\d+)?", "N", (r.error or "")[:120])
                                                for r in self.records if r.status == 200 and not r.success)),
                "ttft_p50_ms": self.ttft(50), "ttft_p99_ms": self.ttft(99),
                "output_tok_s": out_tokens / self.seconds if self.seconds else 0.0,
                "req_s": len(self.admitted()) / self.seconds if self.seconds else 0.0}


async def endpoint(http: httpx.AsyncClient, base: str, tenant: str) -> EndpointConfig:
    models = await http.get(f"{base}/v1/models", headers={"Authorization": f"Bearer {KEYS[tenant]}"})
    return EndpointConfig(base, model=models.json()["data"][0]["id"], api_key=KEYS[tenant], ignore_eos=True,
                          extra_body={"timeout": TIMEOUT_S})


async def send(http: httpx.AsyncClient, cfg: EndpointConfig, tenant: str, prompt: str, out_len: int,
               phase: Phase, origin: float) -> RequestRecord:
    record = RequestRecord(len(phase.records), 0, 0, tenant, 0, out_len)
    phase.records.append(record)
    return await send_request(http, cfg, prompt, record, origin, lambda t: 1)


async def closed_loop(http: httpx.AsyncClient, cfg: EndpointConfig, tenant: str, prompts: list[str], out_len: int,
                      until: float, phase: Phase, origin: float) -> None:
    """One client: the next request when the last one is answered (after Retry-After, if refused)."""
    i = 0
    while time.perf_counter() < until:
        record = await send(http, cfg, tenant, prompts[i % len(prompts)], out_len, phase, origin)
        i += 1
        if record.status == 429:
            await asyncio.sleep(min(float(record.retry_after or 1), max(until - time.perf_counter(), 0)))


async def open_loop(http: httpx.AsyncClient, cfg: EndpointConfig, tenant: str, prompts: list[str], out_len: int,
                    rate: float, until: float, phase: Phase, origin: float) -> None:
    """Poisson arrivals at rate per second, whatever the server answers: offered load."""
    # Seeded per tenant: two tenants' arrivals at the same rate must not come in identical pairs.
    rng = np.random.default_rng([len(phase.records) + 1, *tenant.encode()])
    tasks, i, t = [], 0, time.perf_counter()
    while True:
        t += rng.exponential(1 / rate)
        if t >= until:
            break
        await asyncio.sleep(max(t - time.perf_counter(), 0))
        tasks.append(asyncio.create_task(send(http, cfg, tenant, prompts[i % len(prompts)], out_len, phase, origin)))
        i += 1
    await asyncio.gather(*tasks)


async def run_phase(base: str, name: str, closed: list[tuple[str, int, list[str], int]],
                    opened: list[tuple[str, float, list[str], int]], seconds: float) -> Phase:
    """closed: (tenant, clients, prompts, output tokens); opened: (tenant, requests/s, prompts, output tokens)."""
    phase = Phase(name)
    limits = httpx.Limits(max_connections=2048, max_keepalive_connections=256)
    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0), limits=limits) as http:
        cfgs = {t: await endpoint(http, base, t) for t in KEYS}
        origin = time.perf_counter()
        until = origin + seconds
        tasks = [closed_loop(http, cfgs[t], t, prompts, out_len, until, phase, origin)
                 for t, n, prompts, out_len in closed for _ in range(n)]
        tasks += [open_loop(http, cfgs[t], t, prompts, out_len, rate, until, phase, origin)
                  for t, rate, prompts, out_len in opened]
        await asyncio.gather(*tasks)
        phase.seconds = time.perf_counter() - origin
    s = phase.summary()
    console.print(f"  {name}: {s['admitted']}/{s['requests']} admitted, TTFT p50 {s['ttft_p50_ms'] or 0:.0f} ms "
                  f"p99 {s['ttft_p99_ms'] or 0:.0f} ms, {s['output_tok_s']:.1f} out tok/s, {s['req_s']:.2f} req/s, "
                  f"statuses {s['statuses']}")
    return phase


def start_server(args: argparse.Namespace, admission: list[str], log: Path) -> tuple[subprocess.Popen, str]:
    """admission: flags beside the defaults ([] for the shipped admission)."""
    port = free_port()
    cmd = [tandem_exe(), "serve", "--host", "127.0.0.1", "--port", str(port), "--kv-cache-memory", "1",
           "--api-key", KEYS["A"], "--api-key", KEYS["B"], *args.server_flags, *admission]
    proc = subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    with Progress(console=console, transient=True) as progress:
        wait_healthy(proc, url, 600, log, progress, "server")
    return proc, url


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


@dataclass
class Prompts:
    short: list[str]
    chats: list[str]
    long: list[str]

    @classmethod
    def make(cls, maker: TextMaker, prompt_tokens: int, long_tokens: int) -> Prompts:
        """Fresh prompts (more than any phase sends, so none is a prefix-cache hit)."""
        rng = np.random.default_rng(0)
        return cls([maker.text(rng, prompt_tokens) for _ in range(4000)], [maker.text(rng, 64) for _ in range(400)],
                   [maker.text(rng, long_tokens) for _ in range(400)])


def fresh(prompts: list[str], start: int) -> list[str]:
    return prompts[start:] + prompts[:start]


async def measure_unguarded(args: argparse.Namespace, base: str, p: Prompts) -> dict[str, Phase]:
    """The same server with --admission off, one tenant's view: the references."""
    t, out = args.phase_seconds, args.output_tokens
    await run_phase(base, "warm-up", [("A", 2, fresh(p.short, 3900), 16)], [], 5)
    phases = {"light": await run_phase(base, "light", [("A", 1, fresh(p.short, 0), out)], [], t),
              "capacity": await run_phase(base, "capacity", [("A", args.capacity_clients, fresh(p.short, 100), out)],
                                          [], t)}
    rate = phases["capacity"].summary()["req_s"]
    if not rate:  # a slow machine (float32 on 2 AVX2 cores): 128 streams of 256 + 64 tokens take longer than 30 s
        raise SystemExit(f"no request finished within its {TIMEOUT_S:.0f} s timeout at {args.capacity_clients} "
                         "clients: measure the capacity with fewer (--capacity-clients)")
    phases["1x"] = await run_phase(base, "1x load", [], [("A", rate, fresh(p.short, 1000), out)], t)
    phases["sustained"] = await run_phase(base, "0.7x load", [], [("A", 0.7 * rate, fresh(p.short, 2000), out)], t)
    return phases


async def measure_guarded(args: argparse.Namespace, base: str, p: Prompts, rate: float) -> dict[str, Phase]:
    t, out = args.phase_seconds, args.output_tokens
    a, b = fresh(p.short, 1000), fresh(p.short, 2000)
    await run_phase(base, "warm-up", [("A", 2, fresh(p.short, 3900), 16)], [], 5)
    return {
        "light": await run_phase(base, "light", [("A", 1, fresh(p.short, 0), out)], [], t),
        "1x": await run_phase(base, "1x load", [], [("A", rate / 2, a, out), ("B", rate / 2, a[2000:], out)], t),
        "sustained": await run_phase(base, "0.7x load", [], [("A", 0.35 * rate, b, out),
                                                             ("B", 0.35 * rate, b[1000:], out)], t),
        "overload": await run_phase(base, "10x load", [], [("A", 10 * rate, fresh(p.short, 100), out)], t),
        "alone": await run_phase(base, "B alone", [("B", 2, p.chats, 16)], [], t),
        "flood": await run_phase(base, "B under A's flood", [("B", 2, p.chats, 16)], [("A", 10 * rate, p.long, 8)],
                                 t),
    }


async def measure_slo(args: argparse.Namespace, base: str, p: Prompts, rate: float) -> dict[str, Phase]:
    t, out = args.phase_seconds, args.output_tokens
    await run_phase(base, "warm-up", [("A", 2, fresh(p.short, 3900), 16)], [], 5)
    return {"overload": await run_phase(base, "10x load (slo)", [], [("A", 10 * rate, fresh(p.short, 3000), out)], t)}


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
    ap.add_argument("--phase-seconds", type=float, default=20.0)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--output-tokens", type=int, default=64)
    ap.add_argument("--capacity-clients", type=int, default=128, help="closed-loop clients that saturate the server "
                    "(the default max-num-seqs)")
    ap.add_argument("--flood-prompt-tokens", type=int, default=3000)
    ap.add_argument("server_flags", nargs="*", help="flags for both servers (after --); none: the defaults")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/hostile_traffic"))
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    prompts = Prompts.make(TextMaker(load_tokenizer(None)), args.prompt_tokens, args.flood_prompt_tokens)
    console.print("[bold]reference server: --admission off[/]")
    proc, base = start_server(args, ["--admission", "off"], args.out / "server_reference.log")
    try:
        reference = asyncio.run(measure_unguarded(args, base, prompts))
    finally:
        stop_server(proc)
    rate = reference["capacity"].summary()["req_s"]
    console.print(f"[bold]default server (admission queue); capacity {rate:.2f} req/s[/]")
    proc, base = start_server(args, [], args.out / "server_guarded.log")
    try:
        guarded = asyncio.run(measure_guarded(args, base, prompts, rate))
    finally:
        stop_server(proc)
    slo_ms = 3 * (reference["light"].ttft(99) or 1000.0)
    console.print(f"[bold]--admission slo --slo-ttft-ms {slo_ms:.0f} (3x the light TTFT p99)[/]")
    proc, base = start_server(args, ["--admission", "slo", "--slo-ttft-ms", f"{slo_ms:.0f}"],
                              args.out / "server_slo.log")
    try:
        slo = asyncio.run(measure_slo(args, base, prompts, rate))
    finally:
        stop_server(proc)
    results: dict = {"settings": {k: str(v) for k, v in vars(args).items()} | {"capacity_req_s": rate,
                                                                              "slo_ttft_ms": slo_ms}}
    results["reference"] = {name: ph.summary() for name, ph in reference.items()}
    results["guarded"] = {name: ph.summary() for name, ph in guarded.items()}
    results["slo"] = {name: ph.summary() for name, ph in slo.items()}
    g = results["guarded"]
    results["ratios"] = {
        "refused_at_1x": g["1x"]["refused"],
        "refused_at_0.7x": g["sustained"]["refused"],
        "throughput_1x_guarded_vs_reference": ratio(g["1x"]["output_tok_s"],
                                                    results["reference"]["1x"]["output_tok_s"]),
        "throughput_0.7x_guarded_vs_reference": ratio(g["sustained"]["output_tok_s"],
                                                      results["reference"]["sustained"]["output_tok_s"]),
        "overload_admitted_past_timeout": g["overload"]["admitted_past_timeout"],
        "overload_refused": g["overload"]["refused"],
        "overload_ttft_p99_vs_light": ratio(guarded["overload"].ttft(99), guarded["light"].ttft(99)),
        "flood_b_refused": sum(1 for r in guarded["flood"].records if r.category == "B" and not r.success),
        "flood_b_ttft_p99_vs_alone": ratio(guarded["flood"].ttft(99, "B"), guarded["alone"].ttft(99, "B")),
        "slo_overload_ttft_p99_vs_slo": ratio(slo["overload"].ttft(99), slo_ms),
        "server_errors": sum(ph.summary()["server_errors"] for ph in [*reference.values(), *guarded.values(),
                                                                      *slo.values()]),
        "refusals_without_retry_after": sum(ph.summary()["refused_without_retry_after"]
                                            for ph in [*guarded.values(), *slo.values()]),
    }
    (args.out / "results.json").write_text(json.dumps(results, indent=2))
    plot(guarded, args.out / "hostile_traffic.png")
    goals = {"refused_at_1x": "0", "refused_at_0.7x": "0", "throughput_1x_guarded_vs_reference": ">= 0.97",
             "throughput_0.7x_guarded_vs_reference": ">= 0.97", "overload_admitted_past_timeout": "0",
             "overload_refused": "(most of 10x)", "overload_ttft_p99_vs_light": "(queue: up to the timeout)",
             "flood_b_refused": "0", "flood_b_ttft_p99_vs_alone": "<= 3", "slo_overload_ttft_p99_vs_slo": "<= 1",
             "server_errors": "0", "refusals_without_retry_after": "0"}
    lines = ["| measure | value | goal |", "|---|---:|---|"]
    for key, value in results["ratios"].items():
        shown = f"{value:.2f}" if isinstance(value, float) else str(value)
        lines.append(f"| {key} | {shown} | {goals[key]} |")
    (args.out / "summary.md").write_text("\n".join(lines) + "\n")
    console.print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
