"""The model runner: packs a scheduled step into one batch, runs the model, samples.

It owns the KV pool (one tensor, allocated once) and turns a SchedulerOutput into the flat
tensors the model consumes. Per-step Python work is O(requests), never O(requests x layers).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from tandem.config import EngineConfig
from tandem.engine.block_table import BlockTables
from tandem.engine.connectors.base import KVConnector
from tandem.engine.group_messages import PoolSpec, StepInputs
from tandem.engine.kv_layout import engine_kv_layout
from tandem.engine.logprobs import SampleLogprobs
from tandem.engine.request import Request
from tandem.engine.sampler import sample, token_logprobs
from tandem.engine.step import ScheduledRequest, SchedulerOutput
from tandem.engine.structured import StructuredState, apply_masks
from tandem.kv.host_memory import huge_page_zeros, prefault
from tandem.kv.pool import KVPool, PoolPart, shared_zeros
from tandem.model.arch import ArchConfig
from tandem.model.attention import AttentionMetadata, build_attention_metadata
from tandem.model.causal_lm import CausalLM
from tandem.ops import extension
from tandem.parallel.shm import GroupFailed

GiB = 1 << 30


@dataclass
class StepTimings:
    prepare_s: float = 0.0
    forward_s: float = 0.0
    sample_s: float = 0.0


@dataclass
class RunnerOutput:
    sampled: dict[str, list[int]]
    logprobs: dict[str, list[SampleLogprobs]]
    timings: StepTimings
    # Requests that asked for prompt logprobs: (position of the scored token, its logprobs) this step.
    prompt_logprobs: dict[str, list[tuple[int, SampleLogprobs]]] = field(default_factory=dict)


def num_kv_blocks(config: EngineConfig, arch: ArchConfig) -> int:
    if config.cache.num_blocks is not None:
        return config.cache.num_blocks
    per_block = engine_kv_layout(config, arch).bytes_per_token(arch) * config.cache.block_size
    return max(int(config.cache.kv_cache_memory * GiB) // per_block, 1)


def allocate_kv_pool(config: EngineConfig, arch: ArchConfig, num_blocks: int, device: torch.device,
                     head_ranges: list[tuple[int, int]] | None = None, shared: bool = False) -> KVPool:
    """The pool: [num_layers, 2, num_blocks, block_size, kv heads, row] in the layout's dtype, one part
    per range of KV heads (a worker group's ranks, head_ranges; arch is rank 0's shape). Shared (in
    memory other processes map: a worker group's followers, a prefill worker writing into a decode
    worker) where asked or where there are several parts; on a device other than the CPU rank 0
    holds only its own part (the followers allocate theirs). Otherwise zeroed and lazily committed,
    on huge pages (kv/host_memory.py)."""
    layout = engine_kv_layout(config, arch)
    ranges = head_ranges or [(0, arch.num_kv_heads)]
    total = max(h1 for _, h1 in ranges)
    if device.type != "cpu":
        ranges = ranges[:1]
    parts: list[PoolPart] = []
    for h0, h1 in ranges:
        shape = (arch.num_layers, 2, num_blocks, config.cache.block_size, h1 - h0, layout.row_dim)
        if device.type == "cpu" and (shared or len(ranges) > 1):
            tensor, where = shared_zeros(shape, layout.dtype)
            parts.append(PoolPart((h0, h1), tensor, where))
        else:
            tensor = huge_page_zeros(shape, layout.dtype) if device.type == "cpu" else \
                torch.zeros(shape, dtype=layout.dtype, device=device)
            parts.append(PoolPart((h0, h1), tensor))
        if config.cache.prefault_kv_cache:
            prefault(tensor)
    return KVPool(parts, total)


class ModelRunner:
    def __init__(self, config: EngineConfig, model: CausalLM, num_blocks: int, connector: KVConnector | None = None,
                 shared_kv: bool = False) -> None:
        self.model = model
        self.block_size = config.cache.block_size
        # Batch invariance: the kernels' (ops/batch_invariant.h), and a prompt's rows always through the
        # prefill kernel, a one-token chunk too (a fully cached prompt's last token), as when whole.
        self.deterministic = config.model.deterministic
        self.device = torch.device(config.model.device)
        # In a worker group (engine/worker_group.py) every rank holds its KV heads of these blocks
        # and runs each step; rank 0 sees every rank's part (kv/pool.py) where they share memory.
        self.comm = model.comm
        self.kv_pool = allocate_kv_pool(config, model.cfg, num_blocks, self.device, model.kv_head_ranges or None,
                                        shared_kv)
        self.kv_caches = self.kv_pool.local  # what this process's model runs on
        self.kv_quantized = engine_kv_layout(config, model.cfg).quantized
        if self.comm is not None:
            parts = self.kv_pool.parts
            self.comm.broadcast_object(PoolSpec(num_blocks, [p.shared for p in parts] if len(parts) > 1 else None))
        self.connector = connector or KVConnector()
        self.connector.register_kv_caches(self.kv_pool)
        self.structured: StructuredState | None = None  # set by the engine core when it has a tokenizer
        self.block_tables = BlockTables(config.scheduler.max_num_seqs)  # grows with the longest table

    def _group_forward(self, ids: torch.Tensor, meta: AttentionMetadata, idx: torch.Tensor,
                       after_layer: Callable[[int], None] | None) -> torch.Tensor:
        """Every rank runs the step; any failure here leaves the ranks out of step with each other, so
        it fails the group (the engine fails what is in flight; its owner starts a new group)."""
        try:
            self.comm.broadcast_object(StepInputs(ids, meta, idx))
            return self.model(ids, meta, self.kv_caches, idx, after_layer)
        except GroupFailed:
            raise
        except Exception as e:
            raise GroupFailed(f"a step failed on rank 0 of the worker group: {type(e).__name__}: {e}") from e

    def _decode_row(self, s: ScheduledRequest) -> bool:
        """A row the decode kernel serves: one query token (deterministic: a generated one, not a prompt's)."""
        return s.num_new_tokens == 1 and (not self.deterministic or
                                          s.request.num_computed_tokens >= s.request.num_prompt_tokens)

    def forget(self, request_ids: list[str]) -> None:
        """Drop what the runner keeps for requests whose blocks were freed (their block-table rows)."""
        self.block_tables.release(request_ids)

    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        t0 = time.perf_counter()
        extension.set_batch_invariant(self.deterministic)
        # Single-token queries first: the attention backend serves them with the paged decode kernel.
        items = sched.scheduled
        if self.deterministic or not sched.decodes_first:
            items = sorted(items, key=lambda s: not self._decode_row(s))
        num_decodes = sum(1 for s in items if self._decode_row(s))
        q_lens = np.fromiter((s.num_new_tokens for s in items), dtype=np.int64, count=len(items))
        context_lens = np.fromiter((s.request.num_computed_tokens for s in items), dtype=np.int64, count=len(items))
        block_tables = self.block_tables.gather(items)
        input_ids: list[int] = []
        sampling: list[Request] = []
        drafts: list[list[int]] = []
        logits_indices: list[int] = []
        prompt_rows: list[int] = []  # rows scoring the next prompt token (prompt_logprobs)
        prompt_scored: list[tuple[Request, int]] = []
        offset = 0
        for s in items:
            r, start = s.request, s.request.num_computed_tokens
            if s.num_new_tokens == 1 and not r.spec_token_ids and start + 1 == len(r.all_token_ids):
                # A stream's next token, the common row: its newest token in, one logits row out (no
                # prompt position is left to score).
                input_ids.append(r.all_token_ids[start])
                offset += 1
                sampling.append(r)
                drafts.append([])
                logits_indices.append(offset - 1)
                continue
            tokens = r.all_token_ids + r.spec_token_ids if r.spec_token_ids else r.all_token_ids
            input_ids.extend(tokens[start:start + s.num_new_tokens])
            if r.wants_prompt_logprobs:  # position p's logits score prompt token p + 1
                for p in range(start, min(start + s.num_new_tokens, r.num_prompt_tokens - 1)):
                    prompt_rows.append(offset + p - start)
                    prompt_scored.append((r, p + 1))
            offset += s.num_new_tokens
            if start + s.num_new_tokens >= len(tokens):  # reached the end: this request samples
                # One row for its next token, and one after each of its drafts (verification).
                n = min(len(r.spec_token_ids), s.num_new_tokens - 1)
                sampling.append(r)
                drafts.append(r.spec_token_ids[:n])
                logits_indices.extend(range(offset - 1 - n, offset))
        num_sampling_rows = len(logits_indices)
        rows = np.asarray(logits_indices + prompt_rows, dtype=np.int64)
        meta = build_attention_metadata(q_lens, context_lens, block_tables, num_decodes, self.block_size,
                                        self.device, rows, compact_prefill_blocks=self.kv_quantized)
        ids = torch.from_numpy(np.array(input_ids, dtype=np.int64)).to(self.device)
        idx = torch.from_numpy(rows).to(self.device)
        t1 = time.perf_counter()
        connector = self.connector
        connector.start_step(sched.connector_meta)
        after_layer = None
        if connector.has_layer_work:
            connector.wait_for_layer_load(0)

            def after_layer(layer: int) -> None:
                connector.save_layer(layer)
                connector.wait_for_layer_load(layer + 1)

        # The grammar masks of this step's constrained rows are computed while the model runs.
        masks = self.structured.start_masks(sampling) if self.structured is not None and sampling else None
        if self.comm is None:
            logits = self.model(ids, meta, self.kv_caches, idx, after_layer)
        else:
            logits = self._group_forward(ids, meta, idx, after_layer)
        connector.finish_step()
        t2 = time.perf_counter()
        sampled: dict[str, list[int]] = {}
        logprobs: dict[str, list[SampleLogprobs]] = {}
        prompt_lps: dict[str, list[tuple[int, SampleLogprobs]]] = {}
        if prompt_rows:
            scored = token_logprobs(logits[num_sampling_rows:].cpu(), [r.all_token_ids[p] for r, p in prompt_scored],
                                    [r.sampling_params.prompt_logprobs or 0 for r, _ in prompt_scored])
            for (r, p), lp in zip(prompt_scored, scored, strict=True):
                prompt_lps.setdefault(r.request_id, []).append((p, lp))
            logits = logits[:num_sampling_rows]
        if sampling:
            raw = logits.cpu()
            # Grammars mask a copy: logprobs are the model's own distribution's, as without a grammar.
            masked = apply_masks(raw.clone(), masks.result()) if masks is not None else raw
            out = sample(masked, sampling, drafts if any(drafts) else None, raw)
            for r, tokens, lp in zip(sampling, out.token_ids, out.logprobs, strict=True):
                sampled[r.request_id] = tokens
                if lp is not None:
                    logprobs[r.request_id] = lp
        t3 = time.perf_counter()
        return RunnerOutput(sampled, logprobs, StepTimings(t1 - t0, t2 - t1, t3 - t2), prompt_lps)
