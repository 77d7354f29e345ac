"""Engine settings as plain dataclasses: one place for every default."""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING

from tandem.flags import flag, json_object

if TYPE_CHECKING:  # torch is imported where a dtype is resolved: flags and the API process stay light
    import torch

# How a GGUF file's block-quantized weights are held (a directory's safetensors are dense either way):
#   auto     gguf, except where the dense path of the model's dtype is faster: bfloat16 on a CPU that
#            computes it natively (oneDNN / dpbf16 kernels; measured, README "Quantized weights")
#   gguf     as stored (Q4_0 / Q4_1 / Q5_0 / Q8_0 / Q4_K / Q5_K / Q6_K; other ggml types are
#            dequantized at load), multiplied with activations in float
#   gguf-q8  as stored, activations rounded to int8 per block (llama.cpp's arithmetic; see
#            tandem/model/quant.py for why it is not the default)
#   none     dequantized to the model's dtype
QUANTIZATION_CHOICES = ("auto", "gguf", "gguf-q8", "none")

_DTYPE_NAMES = {"bfloat16": "bfloat16", "bf16": "bfloat16", "float32": "float32", "fp32": "float32",
                "float16": "float16", "fp16": "float16"}


@functools.cache
def auto_dtype() -> torch.dtype:
    """bfloat16 where the CPU computes it natively (AVX512-BF16, AMX, AVX-NE-CONVERT), else float32:
    on plain AVX2 bf16 matmuls are emulated and slower than float32 ones."""
    import torch

    return torch.bfloat16 if torch.ops.mkldnn._is_mkldnn_bf16_supported() else torch.float32


def dtype_name(dtype: object) -> str:
    """A dtype's canonical name ("auto", "bfloat16", "float32", "float16") from a flag's spelling or a
    torch.dtype, without importing torch: the API process reads the engine's settings without it."""
    name = str(dtype).removeprefix("torch.")
    if name == "auto":
        return name
    if name not in _DTYPE_NAMES:
        raise ValueError(f"unsupported dtype {dtype!r}; choose one of {sorted(_DTYPE_NAMES)}")
    return _DTYPE_NAMES[name]


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    import torch

    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return auto_dtype()
    if dtype not in _DTYPE_NAMES:
        raise ValueError(f"unsupported dtype {dtype!r}; choose one of {sorted(_DTYPE_NAMES)}")
    return getattr(torch, _DTYPE_NAMES[dtype])


def available_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


@dataclass
class ModelConfig:
    """Where the weights come from and how they are held."""

    model: str | None = flag(None, "GGUF file or HF directory (default: SmolLM2-135M-Instruct)", positional=True)
    # A name (dtype_name): "auto" is bfloat16 where the CPU computes it natively, else float32 (torch_dtype).
    dtype: str = flag("auto", "activations, KV cache and dense weights; auto: bfloat16 where the CPU computes it "
                      "natively, else float32", choices=("auto", "bfloat16", "float32", "float16"))
    quantization: str = flag(
        "auto", "gguf: a GGUF file's Q4_0/Q4_1/Q5_0/Q8_0/Q4_K/Q5_K/Q6_K weights as stored (4.5-8.5 bits a weight; "
        "other types are dequantized), activations in float; gguf-q8: the same with int8 activations (llama.cpp's "
        "arithmetic); none: dequantize to --dtype; auto: gguf where --dtype is not bfloat16 computed natively; "
        "where it is, none up to 1 GiB of dense weights and gguf-q8 past that (each faster there, measured). A "
        "model directory is dense either way", choices=QUANTIZATION_CHOICES)
    device: str = "cpu"
    max_model_len: int | None = flag(None, "context length (capped by the KV pool's capacity)", unset="the model's")
    seed: int = 0
    # Batch-invariant numerics: each row's result independent of its batch, chunking and cache state,
    # so greedy output is the same alone or batched, streamed or not, cached or not (ops/batch_invariant.h;
    # the compiled AVX512 kernels; the PyTorch fallbacks make no such promise).
    deterministic: bool = flag(True, "batch-invariant kernels: greedy output and logprobs are the same whether a "
                               "request runs alone or batched, streamed or not, from the prefix cache or not, "
                               "prefilled whole or in chunks (AVX512 builds); --no-deterministic: the "
                               "batch-dependent fast paths")

    @property
    def torch_dtype(self) -> torch.dtype:
        """The dtype the engine computes in ("auto" resolved on this CPU)."""
        return parse_dtype(self.dtype)


@dataclass
class StoreSettings:
    """The tiered KV store's settings (kv/store/tiered.py opens the tiers from them)."""

    memory_gib: float = 0.0  # host tier (shared memory), 0: none
    memory_path: str | None = None  # its file under /dev/shm (the deployment's, shared by its workers)
    disk_dir: str | None = None
    disk_gib: float = 8.0
    remote: str | None = None  # mooncake://HOST:PORT
    ttl_s: float | None = None

    @property
    def enabled(self) -> bool:
        return self.memory_gib > 0 or self.disk_dir is not None or self.remote is not None


STORE_FLAGS = "tiered KV store (blocks kept below the pool, loaded instead of recomputed)"
WORKER_GROUP_FLAGS = "worker group (one model across processes)"


@dataclass
class CacheConfig:
    block_size: int = flag(16, "tokens per KV block")
    # The pool is sized from a memory budget unless num_blocks is given explicitly.
    kv_cache_memory: float = flag(4.0, "KV pool size in GiB (allocated once, at start)")
    num_blocks: int | None = flag(None, "KV pool size in blocks (overrides the memory)", unset="from memory")
    # Commit the pool's memory at start-up so that no step pays for first-touch page faults (CPU).
    prefault_kv_cache: bool = flag(True, "commit the KV pool's memory at start-up (no first-touch page faults "
                                   "while serving)")
    # "auto": the model's dtype; "int8": rows of int8 with a float32 scale each (tandem/kv/layout.py).
    kv_cache_dtype: str = flag("auto", "auto: the model's dtype; int8: per token and kv head int8 rows with a "
                               "float32 scale (about a quarter of float32's bytes)", choices=("auto", "int8"))
    enable_prefix_caching: bool = flag(True, "reuse the KV blocks of equal prefixes")
    # "sha256": the same key on every process, host and Python version (the KV store and a KV-aware
    # router match keys across them); "builtin" (Python's tuple hash) is faster, equal across processes
    # of one Python build only.
    prefix_caching_hash_algo: str = "sha256"
    # Record block stored/removed events for a KV-aware router (the server publishes them on ZeroMQ).
    enable_kv_events: bool = False
    # The tiered KV store below the pool (kv/store/): host shared memory (GiB; 0: none) at a path
    # under /dev/shm (default: one per model and geometry), a disk directory and its bound (GiB),
    # a Mooncake master (mooncake://HOST:PORT), and a time to live for stored blocks (seconds).
    kv_offload_memory: float = flag(0.0, "host-memory tier, shared by every worker on the host (0: none)",
                                    metavar="GIB", group=STORE_FLAGS)
    kv_offload_path: str | None = flag(None, "the host tier's file under /dev/shm", metavar="PATH",
                                       group=STORE_FLAGS, unset="one per deployment, removed at exit")
    kv_offload_disk: str | None = flag(None, "disk tier: a directory (survives restarts)", metavar="DIR",
                                       group=STORE_FLAGS, unset="none")
    kv_offload_disk_size: float = flag(8.0, "the disk tier's bound", metavar="GIB", group=STORE_FLAGS)
    kv_store: str | None = flag(None, "distributed tier: a Mooncake Store master", metavar="mooncake://HOST:PORT",
                                group=STORE_FLAGS, unset="none")
    kv_store_ttl: float | None = flag(None, "stored blocks older than this are not used", metavar="SECONDS",
                                      group=STORE_FLAGS, unset="none")

    def store_settings(self) -> StoreSettings:
        return StoreSettings(self.kv_offload_memory, self.kv_offload_path, self.kv_offload_disk,
                             self.kv_offload_disk_size, self.kv_store, self.kv_store_ttl)


@dataclass
class SchedulerConfig:
    max_num_batched_tokens: int = flag(1024, "the per-step token budget shared by prompt chunks and decodes")
    max_num_seqs: int = flag(128, "cap on running requests")
    enable_chunked_prefill: bool = flag(True, "split long prompts across steps")
    # A prompt gets at most this many tokens per step (0: no cap), so that short prompts share steps
    # with a long one instead of queueing behind it (vLLM's name; chunked prefill must be on).
    long_prefill_token_threshold: int = flag(0, "at most this many prompt tokens of one request per step (0: no cap)")
    # While another tenant has requests here, a tenant's prompt tokens per step are at most this (and its
    # weight's share of the budget): the step in flight when another tenant's chat arrives, and each of
    # its decode steps, stay about as short as a step of this many tokens (0: the share alone).
    contended_prefill_chunk: int = flag(128, "while another tenant has requests in the engine, a tenant's prompt "
                                        "tokens per step are at most this (and its weight's share of the budget): "
                                        "a flood's steps stay short (0: the share)")
    # Speculative decoding reserves room for this many extra tokens per running request per step.
    num_lookahead_tokens: int = 0


SPECULATIVE_METHODS = ("ngram", "suffix")


@dataclass
class SpeculativeConfig:
    """Model-free speculative decoding (tandem/speculative/), shaped like vLLM's --speculative-config.

    ngram: prompt lookup, the tokens that followed the last prompt_lookup_max..min tokens earlier in
    the request. suffix: Arctic Inference's suffix decoding, the most frequent continuation of the
    longest matching suffix in the request and in recent outputs of its tenant, as many tokens as
    the match length and their estimated probability allow."""

    method: str = "ngram"
    num_speculative_tokens: int = 8  # the most drafts a request verifies in one step
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    suffix_decoding_max_tree_depth: int = 24  # longest match plus continuation, in tokens
    suffix_decoding_max_cached_requests: int = 1000  # finished outputs kept per tenant (0: the request only)
    suffix_decoding_max_spec_factor: float = 1.0  # drafts <= factor x match length
    suffix_decoding_min_token_prob: float = 0.1  # stop where the continuation's estimated probability falls below
    # Choose each request's drafts every step from its measured acceptance and this machine's step
    # cost, so that a step only grows where the tokens it is expected to gain pay for it (spec/policy.py).
    adaptive: bool = True

    @classmethod
    def parse(cls, value: str | dict | SpeculativeConfig) -> SpeculativeConfig:
        if isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            value = json_object(value, "speculative_config (--speculative-config)")
        if not isinstance(value, dict):
            raise ValueError("speculative_config must be a JSON object")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"speculative_config: unknown key(s) {', '.join(unknown)}; "
                             f"known: {', '.join(sorted(known))}")
        cfg = cls(**value)
        cfg.validate()
        return cfg

    def validate(self) -> None:
        for f in fields(self):
            value, kind = getattr(self, f.name), type(getattr(SpeculativeConfig, f.name))
            ok = isinstance(value, int | float) and not isinstance(value, bool) if kind is float else \
                isinstance(value, kind) and (kind is bool or not isinstance(value, bool))
            if not ok:
                raise ValueError(f"speculative_config {f.name} must be of type {kind.__name__}, got {value!r}")
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_config method must be one of {', '.join(SPECULATIVE_METHODS)}, "
                             f"got {self.method!r}")
        if not 1 <= self.num_speculative_tokens <= 64:
            raise ValueError("num_speculative_tokens must be in [1, 64]")
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max:
            raise ValueError("prompt_lookup_min and prompt_lookup_max must satisfy 1 <= min <= max")
        if self.suffix_decoding_max_tree_depth < 2 or self.suffix_decoding_max_cached_requests < 0:
            raise ValueError("suffix_decoding_max_tree_depth must be >= 2 and max_cached_requests >= 0")
        if self.suffix_decoding_max_spec_factor <= 0 or not 0 <= self.suffix_decoding_min_token_prob <= 1:
            raise ValueError("suffix_decoding_max_spec_factor must be positive and min_token_prob in [0, 1]")


@dataclass
class ParallelConfig:
    num_threads: int = flag(help="torch threads; a worker group splits them between its ranks",
                            default_factory=available_cpus, unset="the usable cores")
    # A worker group (engine/worker_group.py): tensor_parallel_size ranks split every layer;
    # expert_parallel_size ranks hold whole experts. The group has max(tp, ep) ranks; each of the two
    # is 1 or the group's size (tp 1, ep N: attention whole on every rank, experts spread).
    tensor_parallel_size: int = flag(1, "ranks that split every layer (heads, MLP), one all-reduce per row-parallel "
                                     "layer", short="-tp", group=WORKER_GROUP_FLAGS)
    expert_parallel_size: int = flag(1, "ranks that hold whole experts of a mixture-of-experts model (all-to-all "
                                     "dispatch); 1 or the tensor-parallel size, or N with -tp 1 (attention whole on "
                                     "every rank)", short="-ep", group=WORKER_GROUP_FLAGS)
    # The load metric is measured either way.
    enable_eplb: bool = flag(False, "expert-parallel load balancing: hot experts replicated in spare slots",
                             group=WORKER_GROUP_FLAGS)
    eplb_spare_slots: int = flag(1, "expert slots per rank kept for replicas", group=WORKER_GROUP_FLAGS)
    eplb_interval: int = flag(64, "steps between rebalances (the expert-load window)", group=WORKER_GROUP_FLAGS)

    @property
    def world_size(self) -> int:
        return max(self.tensor_parallel_size, self.expert_parallel_size)

    def validate(self) -> None:
        if self.num_threads < 1:
            raise ValueError("num_threads must be positive")
        tp, ep, n = self.tensor_parallel_size, self.expert_parallel_size, self.world_size
        if tp < 1 or ep < 1:
            raise ValueError("tensor_parallel_size and expert_parallel_size must be positive")
        if tp not in (1, n) or ep not in (1, n):
            raise ValueError(f"tensor_parallel_size ({tp}) and expert_parallel_size ({ep}) must each be 1 "
                             "or the group's size: a group of N ranks splits layers, experts, or both, N ways")
        if self.eplb_spare_slots < 0 or self.eplb_interval < 1:
            raise ValueError("eplb_spare_slots must be >= 0 and eplb_interval positive")


@dataclass
class EngineConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    speculative: SpeculativeConfig | None = flag(
        None, 'speculative decoding, e.g. \'{"method": "suffix", "num_speculative_tokens": 8}\' (methods: ngram, '
        'suffix; docs/speculative-decoding.md)', name="speculative_config", metavar="JSON", unset="off")

    @classmethod
    def from_kwargs(cls, model: str | None = None, **kwargs: object) -> EngineConfig:
        """Build a config from flat keyword arguments, as `LLM(...)` and the CLI take them."""
        cfg = cls()
        cfg.model.model = model
        sections = (cfg.model, cfg.cache, cfg.scheduler, cfg.parallel)
        for key, value in kwargs.items():
            if value is None:
                continue
            if key == "speculative_config":
                cfg.speculative = SpeculativeConfig.parse(value)  # type: ignore[arg-type]
                continue
            target = next((s for s in sections if key in s.__dataclass_fields__), None)
            if target is None:
                raise TypeError(f"unknown engine option {key!r}")
            if key == "dtype":
                value = dtype_name(value)
            setattr(target, key, value)
        cfg.validate()
        return cfg

    def validate(self) -> None:
        if self.model.quantization not in QUANTIZATION_CHOICES:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_CHOICES)}, "
                             f"got {self.model.quantization!r}")
        if self.cache.kv_cache_dtype not in ("auto", "int8"):
            raise ValueError(f"kv_cache_dtype must be auto or int8, got {self.cache.kv_cache_dtype!r}")
        if self.cache.block_size < 1 or self.cache.block_size & (self.cache.block_size - 1):
            raise ValueError("block_size must be a power of two")
        if self.cache.num_blocks is not None and self.cache.num_blocks < 1:
            raise ValueError("num_blocks must be positive")
        if self.cache.kv_cache_memory <= 0:
            raise ValueError("kv_cache_memory must be positive")
        if self.scheduler.max_num_batched_tokens < 1 or self.scheduler.max_num_seqs < 1:
            raise ValueError("max_num_batched_tokens and max_num_seqs must be positive")
        if self.scheduler.long_prefill_token_threshold < 0:
            raise ValueError("long_prefill_token_threshold must be 0 (no cap) or positive")
        if self.cache.store_settings().enabled and not self.cache.enable_prefix_caching:
            raise ValueError("the KV store keys blocks by their prefix hashes: it needs prefix caching on")
        if self.cache.kv_store is not None and not self.cache.kv_store.startswith("mooncake://"):
            raise ValueError(f"kv_store must be mooncake://HOST:PORT, got {self.cache.kv_store!r}")
        if self.cache.prefix_caching_hash_algo not in ("builtin", "sha256"):
            raise ValueError("prefix_caching_hash_algo must be 'builtin' or 'sha256'")
        self.parallel.validate()
        if self.parallel.world_size > 1 and self.cache.store_settings().enabled and self.model.device != "cpu":
            raise ValueError("the tiered KV store reads every rank's KV heads through shared host memory: a worker "
                             f"group on {self.model.device} cannot use it yet")
        if self.speculative is not None:
            self.speculative.validate()
