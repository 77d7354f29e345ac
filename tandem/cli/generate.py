"""`tandem generate`: offline generation over prompts or a JSONL file."""

from __future__ import annotations

import argparse
import json
import sys
import time

from tandem.engine.args import add_engine_args, engine_kwargs


def cmd_generate(args: argparse.Namespace) -> int:
    from tandem import LLM, SamplingParams

    prompts: list[str] = list(args.prompt or [])
    if args.input:
        with open(args.input) as f:
            for line in f:
                if line.strip():
                    row = json.loads(line)
                    prompts.append(row["prompt"] if isinstance(row, dict) else row)
    if not prompts:
        print("error: give --prompt TEXT or --input FILE.jsonl", file=sys.stderr)
        return 2
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            max_tokens=args.max_tokens, seed=args.seed, ignore_eos=args.ignore_eos)
    llm = LLM(args.model, **engine_kwargs(args))
    start = time.perf_counter()
    if args.chat:
        outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params)
    else:
        outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    for prompt, out in zip(prompts, outs, strict=True):
        if args.json:
            print(json.dumps({"prompt": prompt, "text": out.outputs[0].text,
                              "finish_reason": out.outputs[0].finish_reason}))
        else:
            print(f"--- {prompt!r}\n{out.outputs[0].text}\n[{out.outputs[0].finish_reason}]")
    n_in = sum(len(o.prompt_token_ids) for o in outs)
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    print(f"{len(outs)} requests, {n_in} prompt + {n_out} output tokens in {elapsed:.2f}s: "
          f"{n_out / elapsed:.1f} output tok/s, {(n_in + n_out) / elapsed:.1f} total tok/s", file=sys.stderr)
    return 0


def add_generate_parser(sub: argparse._SubParsersAction) -> None:
    gen = sub.add_parser("generate", help="offline generation over prompts or a JSONL file")
    add_engine_args(gen)
    gen.add_argument("--prompt", "-p", action="append", help="a prompt (repeatable)")
    gen.add_argument("--input", help="JSONL file: one {\"prompt\": ...} per line")
    gen.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True,
                     help="wrap each prompt as a user message in the chat template")
    gen.add_argument("--max-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--json", action="store_true", help="print one JSON object per output")
    gen.set_defaults(func=cmd_generate)
