"""What an engine core reports about itself: its limits once at start (CoreInfo) and its counters
after steps (CoreStats). Plain data, sent between processes: by the colocated server's core process
and by every cluster worker."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tandem.engine.speed import StepSpeed
from tandem.kv.store.tier import merge_tier_stats

if TYPE_CHECKING:  # for the annotations only: the reports stay plain data, importing no engine or model
    from tandem.engine.core import EngineCore
    from tandem.model.loader import LoadedModel


@dataclass
class CoreStats:
    num_running: int
    num_waiting: int
    kv_usage: float
    num_used_blocks: int
    num_blocks: int
    num_preemptions: int
    prefix_queries: int
    prefix_hits: int
    num_prompt_tokens: int
    num_generation_tokens: int
    time: float
    # Cumulative time of steps that computed prompt tokens, and those tokens: the rate at which
    # queued prompts drain, decodes sharing the steps included (admission control divides them).
    prompt_busy_s: float = 0.0
    num_computed_prompt_tokens: int = 0
    kv_store: dict = field(default_factory=dict)  # tier name -> TierStats (kv/store/tier.py)
    # Prompt tokens queued (waiting requests' tokens still to compute), and the cumulative time and
    # count of steps that ran decodes: what a router predicts a worker's TTFT and TPOT from.
    num_waiting_prompt_tokens: int = 0
    decode_busy_s: float = 0.0
    num_decode_steps: int = 0
    num_decoding: int = 0  # running requests past their prompt: whom a new prompt's chunks would stall
    # Speculative decoding (speculative/decoder.py SpecStats): verifications with drafts, drafts verified,
    # drafts accepted, and accepted drafts at each position.
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: list[int] = field(default_factory=list)
    # Its step times now: the start-up profile (CoreInfo.speed) as measured steps moved it (engine/speed.py).
    speed: StepSpeed | None = None
    # Expert parallelism (model/moe.py): each sparse layer's max / mean rows per rank over its last
    # load window, and the placements EPLB made, all layers together.
    expert_imbalance: list[float] = field(default_factory=list)
    expert_rebalances: int = 0


# Running totals: a deployment's are the sum of its engines'.
_TOTALS = ("num_preemptions", "prefix_queries", "prefix_hits", "num_prompt_tokens", "num_generation_tokens",
           "prompt_busy_s", "num_computed_prompt_tokens", "num_running", "num_waiting", "num_used_blocks",
           "num_blocks", "num_waiting_prompt_tokens", "decode_busy_s", "num_decode_steps", "num_decoding",
           "spec_num_drafts", "spec_num_draft_tokens", "spec_num_accepted_tokens")


@dataclass
class CoreInfo:
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]  # LoadedModel.end_token_ids
    num_blocks: int
    model_name: str
    max_num_seqs: int = 1
    # How this engine keys its blocks (kv/hashing.py), so a router can match them: the extra key
    # (model fingerprint, block size), the block size, the hash and a block's bytes in a store.
    block_key_extra: tuple = ()
    block_size: int = 16
    hash_algo: str = "sha256"
    block_nbytes: int = 0
    # Memory: the bytes of the weights as held (quantized blocks, packed copies) and of one token's KV.
    weight_bytes: int = 0
    kv_bytes_per_token: int = 0
    weight_formats: tuple[str, ...] = ()  # the linear methods in use (model/linear.py), e.g. gguf-Q4_1
    speed: StepSpeed | None = None  # its step times, when it was profiled (serving engines are)
    contended_prefill_chunk: int = 0  # SchedulerConfig's: a tenant's prompt tokens a step beside others


def core_info(core: EngineCore, loaded: LoadedModel) -> CoreInfo:
    """loaded: the model the core runs."""
    from tandem.engine.kv_layout import engine_kv_layout
    from tandem.model.held_weights import weight_bytes, weight_formats

    cache = core.config.cache
    per_token = engine_kv_layout(core.config, loaded.arch).bytes_per_token(loaded.arch)
    return CoreInfo(core.max_model_len, loaded.arch.vocab_size, loaded.end_token_ids,
                    core.num_blocks, loaded.name, core.config.scheduler.max_num_seqs, core.block_key_extra,
                    cache.block_size, cache.prefix_caching_hash_algo, per_token * cache.block_size,
                    weight_bytes(loaded.model), per_token, weight_formats(loaded.model),
                    core.meter.speed.speed if core.meter.speed is not None else None,
                    core.config.scheduler.contended_prefill_chunk)


def core_stats(core: EngineCore) -> CoreStats:
    s = core.stats()
    loads = core.runner.model.expert_loads()
    spec = core.spec.stats if core.spec is not None else None
    m = core.meter
    return CoreStats(s.num_running, s.num_waiting, s.kv_usage, s.num_used_blocks, s.num_blocks,
                     s.num_preemptions, s.prefix_queries, s.prefix_hits, m.num_prompt_tokens,
                     m.num_generation_tokens, time.monotonic(), m.prompt_busy_s, m.num_computed_prompt_tokens,
                     core.connector.stats().get("tiers", {}), s.num_waiting_prompt_tokens,
                     m.decode_busy_s, m.num_decode_steps, s.num_decoding,
                     *((spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens, list(spec.accepted_per_pos))
                       if spec else (0, 0, 0, [])),
                     speed=m.speed.speed if m.speed is not None else None,
                     expert_imbalance=[load.imbalance for load in loads if load.per_rank],
                     expert_rebalances=sum(load.rebalances for load in loads))


def sum_stats(parts: list[CoreStats]) -> CoreStats | None:
    """Several engines' stats as one deployment's (None: none has reported)."""
    if not parts:
        return None
    totals = {f: sum(getattr(s, f) for s in parts) for f in _TOTALS}
    blocks, used = totals["num_blocks"], totals["num_used_blocks"]
    per_pos = [0] * max(len(s.spec_accepted_per_pos) for s in parts)
    for s in parts:
        for i, n in enumerate(s.spec_accepted_per_pos):
            per_pos[i] += n
    return CoreStats(kv_usage=used / blocks if blocks else 0.0, time=time.monotonic(),
                     kv_store=merge_tier_stats([s.kv_store for s in parts]), spec_accepted_per_pos=per_pos, **totals)
