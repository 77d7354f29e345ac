"""An agent's loop against one `tandem serve`: what turn N costs when each turn resends a growing history.

    .venv/bin/python benchmarks/agent_loop.py                      # 10 turns, the default model
    .venv/bin/python benchmarks/agent_loop.py --turns 10 --history-tokens 2000 --result-tokens 300

Each loop starts from a ~2k-token history (instructions and a first request) and adds, every turn, a
~300-token tool result, as an agent does. Three loops run in the same server, one after another:
- `responses`: the Responses API with previous_response_id: the server keeps the conversation (its
  token ids and, retained in the pool, its KV), and each turn sends only the new tool result;
- `chat`: the same turns sent as full chat histories (what a chat-completions agent sends), whose
  history the prefix cache may or may not still hold;
- `recompute`: each turn's full history with a fresh cache salt, so nothing of it is cached: the cost
  of recomputing the history (the denominator of the goal).
Between turns another tenant sends unique prompts worth `--pressure` pools, so whatever is not kept
on purpose is evicted. Every request streams; TTFT is the time to the first generated text.

Goal (issue #49): turn 10's TTFT at most 0.25x recomputing its history. Writes
benchmarks/results/agent_loop.json and docs/agent_loop.png.
"""

from __future__ import annotations

import argparse
import json
import time
import uuid
from pathlib import Path

import httpx
import matplotlib
from rich.progress import Progress
from rich.table import Table

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from server_process import add_server_args, console, scrape, serving  # noqa: E402

from tandem.cpu_info import cpu_model_name  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
INSTRUCTIONS = "You are a coding agent. Read each tool result and decide the next step. Answer briefly."
_SENTENCE = ("the build step reads the cache key from the manifest then compiles every module that changed "
             "since the last run and writes the objects next to their sources before linking")
WORDS = _SENTENCE.split(" ")


def text_of(tokens: int, seed: int) -> str:
    """About `tokens` tokens of plain text (a word is about 1.3 tokens here), different per seed."""
    n = int(tokens / 1.3)
    return " ".join(f"{WORDS[(i * 7 + seed) % len(WORDS)]}{'' if (i + seed) % 11 else f' #{seed}-{i}'}"
                    for i in range(n))


def stream_ttft(client: httpx.Client, path: str, body: dict) -> tuple[float, dict, str]:
    """Send a streaming request; (seconds to its first generated text, its last JSON event, its text)."""
    start = time.perf_counter()
    ttft = None
    last: dict = {}
    text = ""
    with client.stream("POST", path, json=body | {"stream": True}, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            last = event
            delta = event.get("delta", "") if event.get("type") == "response.output_text.delta" else "".join(
                c.get("delta", {}).get("content") or "" for c in event.get("choices", []))
            if delta and ttft is None:
                ttft = time.perf_counter() - start
            text += delta
    return (ttft if ttft is not None else time.perf_counter() - start), last, text


def pressure(client: httpx.Client, tokens: int, round_: int) -> None:
    """Another tenant's unique prompts, `tokens` in all, in chunks that fit the context."""
    chunk = 1500
    for i in range(max(tokens // chunk, 1)):
        client.post("/v1/completions", timeout=600, json={
            "prompt": text_of(chunk, 1000 * round_ + i), "max_tokens": 1, "cache_salt": "other-tenant"})


def run_loop(client: httpx.Client, kind: str, args: argparse.Namespace, pool_tokens: int) -> list[dict]:
    history = text_of(args.history_tokens, 1)
    messages = [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": history}]
    previous = None
    turns = []
    for turn in range(1, args.turns + 1):
        result = f"Tool result {turn}: " + text_of(args.result_tokens, 100 + turn)
        if turn > 1:
            messages.append({"role": "user", "content": result})
        if kind == "responses":
            body = {"instructions": INSTRUCTIONS, "input": history if turn == 1 else result,
                    "max_output_tokens": args.output_tokens, "temperature": 0, "cache_salt": kind}
            if previous is not None:
                body["previous_response_id"] = previous
            ttft, last, reply = stream_ttft(client, "/v1/responses", body)
            response = last.get("response", {})
            previous = response.get("id")
            usage = response.get("usage") or {}
            prompt, cached = usage.get("input_tokens", 0), usage.get("input_tokens_details", {}).get("cached_tokens", 0)
        else:
            # Each loop its own cache salt (so one cannot reuse another's blocks); a fresh one per turn
            # for `recompute`, so that nothing of its history is cached.
            body = {"messages": messages, "max_tokens": args.output_tokens, "temperature": 0,
                    "stream_options": {"include_usage": True},
                    "cache_salt": uuid.uuid4().hex if kind == "recompute" else kind}
            ttft, last, reply = stream_ttft(client, "/v1/chat/completions", body)
            usage = last.get("usage") or {}
            prompt, cached = usage.get("prompt_tokens", 0), usage.get("prompt_tokens_details", {}).get(
                "cached_tokens", 0)
        messages.append({"role": "assistant", "content": reply or "Next."})
        turns.append({"turn": turn, "ttft_s": ttft, "prompt_tokens": prompt, "cached_tokens": cached})
        console.print(f"  {kind} turn {turn}: TTFT {ttft * 1e3:.0f} ms, prompt {prompt}, cached {cached}")
        if kind != "recompute":  # nothing of a recomputed history is cached: pressure would change nothing
            pressure(client, int(args.pressure * pool_tokens), turn)
    return turns


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--turns", type=int, default=10)
    p.add_argument("--history-tokens", type=int, default=2000)
    p.add_argument("--result-tokens", type=int, default=300)
    p.add_argument("--output-tokens", type=int, default=16)
    p.add_argument("--kv-cache-memory", default="0.8",
                   help="the server's pool (GiB): room for the conversation retained (at most half of it), "
                        "small enough that the pressure tells")
    p.add_argument("--pressure", type=float, default=0.75,
                   help="another tenant's unique tokens per turn, in pools: enough to evict what is not retained")
    p.add_argument("--model", default=None)
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/agent_loop.json")
    p.add_argument("--plot", type=Path, default=ROOT / "docs/agent_loop.png")
    add_server_args(p, ROOT / "benchmarks/results/agent_loop")
    args = p.parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    flags = ([args.model] if args.model else []) + ["--kv-cache-memory", args.kv_cache_memory]
    results: dict = {"machine": cpu_model_name(), "args": {k: str(v) for k, v in vars(args).items()}, "loops": {}}
    with Progress(console=console) as progress, serving("agent-loop", flags, args, progress) as server:
        metrics = scrape(server.url)
        pool_blocks = next(v for (name, _), v in metrics.items() if name == "tandem:kv_cache_total_blocks")
        pool_tokens = int(pool_blocks * 16)
        results["pool_tokens"] = pool_tokens
        with httpx.Client(base_url=server.url) as client:
            for kind in ("responses", "chat", "recompute"):
                results["loops"][kind] = run_loop(client, kind, args, pool_tokens)
    loops = results["loops"]
    last = {k: v[-1]["ttft_s"] for k, v in loops.items()}
    results["turn_n_ratio_vs_recompute"] = last["responses"] / last["recompute"]
    results["turn_n_chat_ratio_vs_recompute"] = last["chat"] / last["recompute"]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))

    table = Table(title=f"agent loop, turn TTFT (ms), pool {pool_tokens} tokens, {cpu_model_name()}")
    table.add_column("turn")
    for kind in loops:
        table.add_column(kind)
        table.add_column(f"{kind} cached/prompt")
    for i in range(args.turns):
        row = [str(i + 1)]
        for kind in loops:
            t = loops[kind][i]
            row += [f"{t['ttft_s'] * 1e3:.0f}", f"{t['cached_tokens']}/{t['prompt_tokens']}"]
        table.add_row(*row)
    console.print(table)
    console.print(f"turn {args.turns}: responses {results['turn_n_ratio_vs_recompute']:.3f}x recompute, "
                  f"chat {results['turn_n_chat_ratio_vs_recompute']:.3f}x (goal: responses <= 0.25x)")

    fig, ax = plt.subplots(figsize=(7, 4))
    for kind, style in (("responses", "o-"), ("chat", "s--"), ("recompute", "^:")):
        ax.plot([t["turn"] for t in loops[kind]], [t["ttft_s"] * 1e3 for t in loops[kind]], style, label=kind)
    ax.set_xlabel("turn")
    ax.set_ylabel("TTFT (ms)")
    ax.set_title(f"Agent loop: {args.history_tokens}-token history + {args.result_tokens} tokens a turn, "
                 f"another tenant's pressure\n{cpu_model_name()}", fontsize=9)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    args.plot.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.plot, dpi=110)
    console.print(f"wrote {args.out} and {args.plot}")


if __name__ == "__main__":
    main()
