"""Engine options as command-line flags, named as vLLM names them, and back.

Every command that starts an engine (serve, worker, profile, a Ray actor) reads the same flags, and
a process that starts workers hands its own flags on as a command line (engine_argv).
"""

from __future__ import annotations

import argparse

from tandem.config import QUANTIZATION_CHOICES, CacheConfig, ModelConfig, ParallelConfig, SchedulerConfig


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Engine options as flags, named as vLLM names them."""
    p.add_argument("model", nargs="?", default=None, help="GGUF file or HF directory (default: SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32", "float16"],
                   help="auto: bfloat16 where the CPU computes it natively, else float32")
    p.add_argument("--quantization", default=ModelConfig.quantization, choices=QUANTIZATION_CHOICES,
                   help="gguf: a GGUF file's Q4_0/Q4_1/Q5_0/Q8_0/Q4_K/Q5_K/Q6_K weights as stored (4.5-8.5 bits a "
                        "weight; other types are dequantized), activations "
                        "in float; gguf-q8: the same with int8 activations (llama.cpp's arithmetic); none: "
                        "dequantize to --dtype; auto: gguf where --dtype is not bfloat16 computed natively; where "
                        "it is, none up to 1 GiB of dense weights and gguf-q8 past that (each faster there, "
                        "measured). A model directory is dense either way")
    p.add_argument("--deterministic", action=argparse.BooleanOptionalAction, default=ModelConfig.deterministic,
                   help="batch-invariant kernels: greedy output and logprobs are the same whether a request runs "
                        "alone or batched, streamed or not, from the prefix cache or not, prefilled whole or in "
                        "chunks (AVX512 builds); --no-deterministic: the batch-dependent fast paths")
    p.add_argument("--kv-cache-memory", type=float, default=CacheConfig.kv_cache_memory, help="KV pool size in GiB")
    p.add_argument("--num-blocks", type=int, default=None, help="KV pool size in blocks (overrides the memory)")
    p.add_argument("--block-size", type=int, default=CacheConfig.block_size)
    p.add_argument("--kv-cache-dtype", default=CacheConfig.kv_cache_dtype, choices=["auto", "int8"],
                   help="auto: the model's dtype; int8: per token and kv head int8 rows with a float32 scale "
                        "(about a quarter of float32's bytes)")
    p.add_argument("--prefault-kv-cache", action=argparse.BooleanOptionalAction, default=CacheConfig.prefault_kv_cache,
                   help="commit the KV pool's memory at start-up (no first-touch page faults while serving)")
    p.add_argument("--max-num-batched-tokens", type=int, default=SchedulerConfig.max_num_batched_tokens)
    p.add_argument("--max-num-seqs", type=int, default=SchedulerConfig.max_num_seqs)
    p.add_argument("--long-prefill-token-threshold", type=int, default=SchedulerConfig.long_prefill_token_threshold,
                   help="at most this many prompt tokens of one request per step (0: no cap)")
    p.add_argument("--contended-prefill-chunk", type=int, default=SchedulerConfig.contended_prefill_chunk,
                   help="while another tenant has requests in the engine, a tenant's prompt tokens per step are at "
                        "most this (and its weight's share of the budget): a flood's steps stay short (0: the share)")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--num-threads", type=int, default=None,
                   help="torch threads (default: the usable cores); a worker group splits them between its ranks")
    group = p.add_argument_group("worker group (one model across processes)")
    group.add_argument("--tensor-parallel-size", "-tp", type=int, default=ParallelConfig.tensor_parallel_size,
                       help="ranks that split every layer (heads, MLP), one all-reduce per row-parallel layer")
    group.add_argument("--expert-parallel-size", "-ep", type=int, default=ParallelConfig.expert_parallel_size,
                       help="ranks that hold whole experts of a mixture-of-experts model (all-to-all dispatch); "
                            "1 or the tensor-parallel size, or N with -tp 1 (attention whole on every rank)")
    group.add_argument("--enable-eplb", action=argparse.BooleanOptionalAction, default=ParallelConfig.enable_eplb,
                       help="expert-parallel load balancing: hot experts replicated in spare slots")
    group.add_argument("--eplb-spare-slots", type=int, default=ParallelConfig.eplb_spare_slots,
                       help="expert slots per rank kept for replicas")
    group.add_argument("--eplb-interval", type=int, default=ParallelConfig.eplb_interval,
                       help="steps between rebalances (the expert-load window)")
    p.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='speculative decoding, e.g. \'{"method": "suffix", "num_speculative_tokens": 8}\' '
                        '(methods: ngram, suffix; README "Speculative decoding"); off by default')
    store = p.add_argument_group("tiered KV store (blocks kept below the pool, loaded instead of recomputed)")
    store.add_argument("--kv-offload-memory", type=float, default=CacheConfig.kv_offload_memory, metavar="GIB",
                       help="host-memory tier, shared by every worker on the host (0: none)")
    store.add_argument("--kv-offload-path", default=None, metavar="PATH",
                       help="the host tier's file under /dev/shm (default: one per deployment, removed at exit)")
    store.add_argument("--kv-offload-disk", default=None, metavar="DIR",
                       help="disk tier: a directory (survives restarts)")
    store.add_argument("--kv-offload-disk-size", type=float, default=CacheConfig.kv_offload_disk_size, metavar="GIB")
    store.add_argument("--kv-store", default=None, metavar="mooncake://HOST:PORT",
                       help="distributed tier: a Mooncake Store master")
    store.add_argument("--kv-store-ttl", type=float, default=None, metavar="SECONDS",
                       help="stored blocks older than this are not used")


def engine_argv(args: argparse.Namespace) -> list[str]:
    """The engine flags of args, as a command line (for workers started from this process)."""
    argv = [args.model] if args.model else []
    for key, value in engine_kwargs(args).items():
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            argv.append(flag if value else f"--no-{flag[2:]}")
        elif value is not None:
            argv += [flag, str(value)]
    return argv


def _engine_dests() -> tuple[str, ...]:
    """The attribute names add_engine_args declares (the model's excepted): the one list of engine options."""
    p = argparse.ArgumentParser(add_help=False)
    add_engine_args(p)
    return tuple(a.dest for a in p._actions if a.dest != "model")


ENGINE_DESTS = _engine_dests()


def engine_kwargs(args: argparse.Namespace) -> dict:
    """The engine options of args (parsed by a parser add_engine_args built), by name."""
    return {dest: getattr(args, dest) for dest in ENGINE_DESTS}
