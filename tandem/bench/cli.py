"""`tandem bench serve | sweep | compare`. Flags are named as `vllm bench serve` names them where the concept is
the same, so a command line (and a result file) moves between the two."""

from __future__ import annotations

import argparse

from tandem.bench.metrics import DEFAULT_PERCENTILES, METRICS
from tandem.bench.workloads import DATASETS, WorkloadConfig

_W = WorkloadConfig()


class BenchHelpFormatter(argparse.HelpFormatter):
    """Shows a flag's default unless its help already explains it or there is nothing to show."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        # Identity, not equality: a default of 0 is worth showing, False (a store_true flag) is not.
        if "default" in text or any(action.default is x for x in (None, False, argparse.SUPPRESS)):
            return text
        return f"{text} (default: %(default)s)".lstrip()


def _rate(text: str) -> float:
    return float(text)  # "inf" parses too: everything at once


def add_workload_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("workload (generated locally from --seed)")
    g.add_argument("--dataset-name", default="random", choices=DATASETS, help="the workload")
    g.add_argument("--dataset-path", default=None, help="mooncake_trace: the JSONL trace")
    g.add_argument("--num-prompts", type=int, default=_W.num_prompts,
                   help="requests to send (multi_turn: conversations; mooncake_trace: the first N rows)")
    g.add_argument("--seed", type=int, default=_W.seed, help="seeds prompts, lengths and arrivals")
    g.add_argument("--random-input-len", type=int, default=_W.random_input_len, help="prompt tokens")
    g.add_argument("--random-output-len", type=int, default=_W.random_output_len, help="max_tokens")
    g.add_argument("--random-range-ratio", type=float, default=_W.random_range_ratio,
                   help="lengths uniform in [len * (1 - r), len * (1 + r)]")
    g.add_argument("--random-prefix-len", type=int, default=_W.random_prefix_len,
                   help="tokens of one prefix shared by every random prompt")
    g.add_argument("--synthetic-chat-input-len", type=int, default=_W.synthetic_chat_input_len,
                   help="mean prompt length (lognormal, ShareGPT-like)")
    g.add_argument("--synthetic-chat-output-len", type=int, default=_W.synthetic_chat_output_len,
                   help="mean output length (lognormal)")
    g.add_argument("--synthetic-chat-sigma", type=float, default=_W.synthetic_chat_sigma,
                   help="lognormal shape: larger is a longer tail")
    g.add_argument("--synthetic-chat-max-len", type=int, default=_W.synthetic_chat_max_len,
                   help="prompt + output cap (prompts are also capped at half of it)")
    g.add_argument("--prefix-repetition-num-prefixes", type=int, default=_W.prefix_repetition_num_prefixes,
                   help="distinct shared prefixes (requests cycle through them)")
    g.add_argument("--prefix-repetition-prefix-len", type=int, default=_W.prefix_repetition_prefix_len,
                   help="tokens of each shared prefix")
    g.add_argument("--prefix-repetition-suffix-len", type=int, default=_W.prefix_repetition_suffix_len,
                   help="tokens after the prefix, unique per request")
    g.add_argument("--prefix-repetition-output-len", type=int, default=_W.prefix_repetition_output_len,
                   help="max_tokens")
    g.add_argument("--multi-turn-turns", type=int, default=_W.multi_turn_turns, help="user turns per conversation")
    g.add_argument("--multi-turn-input-len", type=int, default=_W.multi_turn_input_len,
                   help="tokens of each new user message")
    g.add_argument("--multi-turn-output-len", type=int, default=_W.multi_turn_output_len,
                   help="max_tokens of each reply")
    g.add_argument("--long-short-long-fraction", type=float, default=_W.long_short_long_fraction,
                   help="share of requests that are long")
    g.add_argument("--long-short-long-input-len", type=int, default=_W.long_short_long_input_len,
                   help="prompt tokens of a long request")
    g.add_argument("--long-short-long-output-len", type=int, default=_W.long_short_long_output_len,
                   help="max_tokens of a long request")
    g.add_argument("--long-short-short-input-len", type=int, default=_W.long_short_short_input_len,
                   help="prompt tokens of a short request")
    g.add_argument("--long-short-short-output-len", type=int, default=_W.long_short_short_output_len,
                   help="max_tokens of a short request")
    g.add_argument("--copy-input-len", type=int, default=_W.copy_input_len,
                   help="copy: about this many prompt tokens of code, docs or JSON that ship with Python")
    g.add_argument("--copy-output-len", type=int, default=_W.copy_output_len, help="copy: max_tokens")
    g.add_argument("--trace-time-scale", type=float, default=_W.trace_time_scale,
                   help="multiply trace timestamps (0.5 replays twice as fast)")
    g.add_argument("--trace-block-size", type=int, default=_W.trace_block_size, help="tokens per trace hash id")


def add_run_args(p: argparse.ArgumentParser, sweep: bool = False) -> None:
    add_target_args(p)
    add_load_args(p, sweep)
    add_output_args(p)


def add_target_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("target")
    g.add_argument("--backend", default="openai", choices=["openai", "openai-chat"],
                   help="openai: /v1/completions; openai-chat: /v1/chat/completions")
    g.add_argument("--base-url", default=None, help="server base URL (default http://HOST:PORT)")
    g.add_argument("--host", default="127.0.0.1", help="server host when no --base-url")
    g.add_argument("--port", type=int, default=8000, help="server port when no --base-url")
    g.add_argument("--endpoint", default=None, help="/v1/completions or /v1/chat/completions (default: by --backend)")
    g.add_argument("--model", default=None, help="model name to send (default: the first of GET /v1/models)")
    g.add_argument("--tokenizer", default=None,
                   help="local HF directory or GGUF file that counts tokens (default: Tandem's default model's)")
    g.add_argument("--api-key", default=None, help="bearer token (default: $TANDEM_API_KEY or $OPENAI_API_KEY)")
    g.add_argument("--temperature", type=float, default=0.0, help="sampling temperature sent")
    g.add_argument("--ignore-eos", action="store_true", help="generate exactly the requested output lengths")
    g.add_argument("--extra-body", default=None, help="JSON object merged into every request body")
    g.add_argument("--request-timeout", type=float, default=600.0,
                   help="seconds without data before a request fails")


def add_load_args(p: argparse.ArgumentParser, sweep: bool = False) -> None:
    g = p.add_argument_group("load")
    if sweep:
        g.add_argument("--request-rates", required=True, help="comma-separated request rates, e.g. 1,2,4")
    else:
        g.add_argument("--request-rate", type=_rate, default=float("inf"),
                       help="requests per second (inf: all at once)")
    g.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of the gaps: 1 is Poisson, < 1 burstier, > 1 more regular")
    g.add_argument("--max-concurrency", type=int, default=None, help="cap on requests in flight")
    g.add_argument("--think-time", type=float, default=0.0,
                   help="multi-turn: mean seconds (exponential, seeded) between a reply and the user's next turn")
    g.add_argument("--num-warmups", type=int, default=0, help="unmeasured requests sent first")


def add_output_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("metrics and output")
    g.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS",
                   help="SLOs in ms, e.g. ttft:500 tpot:50 e2el:5000; goodput counts requests meeting all")
    g.add_argument("--percentile-metrics", default=",".join(METRICS), help="which of ttft,tpot,itl,e2el to report")
    g.add_argument("--metric-percentiles", default=",".join(f"{p:g}" for p in DEFAULT_PERCENTILES),
                   help="percentiles to report besides mean and median, e.g. 50,90,99")
    g.add_argument("--save-result", action="store_true", help="write the JSON result and per-request records")
    g.add_argument("--save-detailed", action="store_true", help="add vLLM's per-request arrays to the JSON")
    g.add_argument("--result-dir", default=None, help="directory for results and plots (default: .)")
    g.add_argument("--result-filename", default=None, help="JSON file name (default: from backend, rate, model)")
    g.add_argument("--label", default=None, help="name of this run in the result and in compare")
    g.add_argument("--metadata", nargs="*", default=None, metavar="KEY=VALUE", help="extra fields for the JSON")
    g.add_argument("--plot", action="store_true", help="write PNG plots next to the result")
    g.add_argument("--report", default=None, metavar="FILE.html",
                   help="write one self-contained HTML page: the settings, the metrics table and the plots")
    g.add_argument("--disable-tqdm", action="store_true", help="no progress bar")


def _cmd_serve(args: argparse.Namespace) -> int:
    from tandem.bench.serve import benchmark

    result = benchmark(args)
    return 0 if result["completed"] else 1


def _cmd_sweep(args: argparse.Namespace) -> int:
    from tandem.bench.sweep import sweep

    summary = sweep(args)
    return 0 if any(r["completed"] for r in summary["runs"]) else 1


def _cmd_compare(args: argparse.Namespace) -> int:
    from tandem.bench.compare import compare_files

    fields = [f.strip() for f in args.fields.split(",") if f.strip()] if args.fields else None
    print(compare_files(args.results, fields))
    if args.report:
        from tandem.bench.compare import compare_html

        print(f"report: {compare_html(args.results, args.report)}")
    return 0


def add_bench_parser(sub: argparse._SubParsersAction) -> argparse._SubParsersAction:
    """`tandem bench`; returns its subcommands, for the commands that layers above add (`bench sim`)."""
    bench = sub.add_parser("bench", help="benchmark an OpenAI-compatible server (like `vllm bench serve`)")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)

    serve = bench_sub.add_parser("serve", help="one benchmark run against a running server",
                                 formatter_class=BenchHelpFormatter)
    add_run_args(serve)
    add_workload_args(serve)
    serve.set_defaults(func=_cmd_serve)

    sweep = bench_sub.add_parser("sweep", help="one run per request rate, then a goodput-vs-rate plot",
                                 formatter_class=BenchHelpFormatter)
    add_run_args(sweep, sweep=True)
    add_workload_args(sweep)
    sweep.set_defaults(func=_cmd_sweep, request_rate=float("inf"))

    compare = bench_sub.add_parser("compare", help="result files side by side, with ratios to the first")
    compare.add_argument("results", nargs="+", help="result JSON files (the first is the baseline)")
    compare.add_argument("--fields", default=None, help="comma-separated result fields (default: the headline)")
    compare.add_argument("--report", default=None, metavar="FILE.html",
                         help="the runs on one self-contained HTML page, with their latency CDFs overlaid (from "
                         "the per-request records --save-result keeps next to each result)")
    compare.set_defaults(func=_cmd_compare)
    return bench_sub
