"""What every decoder-only family shares: the checkpoint's linear layers fused the same way (q/k/v
and gate/up into one matmul each), loading HF-named weights into that layout, a tied head, and the
forward contract the model runner calls (model/llama.py, model/gemma3.py implement it)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from tandem.model.arch import ArchConfig
from tandem.model.attention import AttentionMetadata
from tandem.model.layers import RMSNorm, RotaryEmbedding
from tandem.model.linear import DENSE, Embedding, Linear, LinearMethod, Weight
from tandem.model.moe import ExpertLoad, SparseMoE
from tandem.model.native_stack import build_layer_stack, run_layer_stack, stack_serves

Methods = Mapping[str, LinearMethod]  # linear module name -> how it holds its weight (model/linear.py)


def gather_columns(comm: Any, vocab: int, t: torch.Tensor) -> torch.Tensor:
    """Every rank's columns of t side by side ([rows, local vocab] -> [rows, vocab]): gathered as
    rows of the transpose, since the ranks' column counts may differ. No rows (a step that samples
    nothing, alike on every rank): nothing to gather."""
    if t.shape[0] == 0:
        return t.new_empty(0, vocab)
    return torch.cat(comm.all_gather(t.t().contiguous())).t().contiguous()


class CausalLM(nn.Module):
    """A family's model: the embedding, its decoder layers (layer_cls(cfg, dtype, methods, i)), the
    final norm, the head and the global rotary table; subclasses add what else they hold and compute
    their rotary tables again in init_buffers."""

    def __init__(self, cfg: ArchConfig, dtype: torch.dtype, methods: Methods | None,
                 layer_cls: Callable[[ArchConfig, torch.dtype, Methods, int], nn.Module]) -> None:
        """methods: per linear module (and embed_tokens), how it holds its weight; dense by default."""
        super().__init__()
        methods = methods or {}
        self.cfg = cfg
        self.embed_tokens = Embedding(cfg.local_vocab, cfg.hidden_size, dtype, methods.get("embed_tokens", DENSE),
                                      cfg.vocab_shard[0] if cfg.vocab_shard else 0)
        self.layers = nn.ModuleList(layer_cls(cfg, dtype, methods, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.lm_head = Linear(cfg.hidden_size, cfg.local_vocab, False, dtype, methods.get("lm_head", DENSE))
        self.rotary = RotaryEmbedding.of(cfg, dtype)
        for p in self.parameters():
            p.requires_grad_(False)
        # Set by the loader (model/fingerprint.py); a model built by hand is fingerprinted by its weights.
        self.fingerprint: int | None = None
        # The native layer stack (model/native_stack.py), built on the first forward, once the weights
        # are in their final form; native_layers = False keeps every step on the Python loop.
        self.native_layers = True
        self._stack: Any | None = None
        self._stack_built = False
        self.native_steps = 0  # steps the stack served (tests and benchmarks read it)
        self.comm: Any | None = None  # the worker group's collectives (parallel/comm.py), once joined
        self._moe_layers: list[SparseMoE] | None = None
        self.kv_head_ranges: list[tuple[int, int]] = []  # in a group: each rank's KV heads (rank 0 gathers them)

    def join_group(self, comm: Any, shard: Any) -> None:
        """Step as one shard (model/tensor_parallel.py's Shard, as built) of a worker group:
        row-parallel outputs are summed over the group, and mixture-of-experts layers dispatch
        through it. The native stack all-reduces over the group's shared-memory exchange; over
        torch.distributed the Python loop serves every step."""
        from tandem.model.tensor_parallel import row_parallel

        self.comm = comm
        self.native_layers = self.native_layers and comm.native_group() is not None
        for name, module in self.named_modules():
            if isinstance(module, Linear) and row_parallel(name) and shard.splits_layers:
                module.reduce = comm.all_reduce
            if hasattr(module, "join_group") and module is not self:
                module.join_group(comm, shard)
        if self.cfg.vocab_shard is not None:  # vocab-parallel: each rank embeds and scores its token ids
            self.embed_tokens.reduce = comm.all_reduce
            self.lm_head.reduce = functools.partial(gather_columns, comm, self.cfg.vocab_size)

    def expert_loads(self) -> list[ExpertLoad]:
        """Each mixture-of-experts layer's last load window (model/moe.py; none for a dense model)."""
        # Found once: the engine reports after every step, and walking every module each time cost a
        # 135M model's core about 1 ms a step.
        if self._moe_layers is None:
            self._moe_layers = [m for m in self.modules() if isinstance(m, SparseMoE)]
        return [m.load for m in self._moe_layers]

    def layer_stack(self) -> Any | None:
        if not self.native_layers:
            return None
        if not self._stack_built:
            self._stack, self._stack_built = build_layer_stack(self), True
            if self._stack is not None and self.comm is not None:
                self._stack.set_group(*self.comm.native_group())
        return self._stack

    def native_layers_forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor],
                              local_rope: tuple[torch.Tensor, torch.Tensor] | None, kv_caches: torch.Tensor,
                              meta: AttentionMetadata,
                              after_layer: Callable[[int], None] | None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Every layer through the native stack, as the Python loop would leave (x, residual); None
        when the stack cannot serve this step (the caller runs its loop)."""
        stack = self.layer_stack() if after_layer is None else None
        if stack is None or not stack_serves(stack, x, kv_caches, meta):
            return None
        self.native_steps += 1
        return run_layer_stack(stack, x, rope, local_rope, kv_caches, meta)

    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata, kv_caches: torch.Tensor,
                logits_indices: torch.Tensor, after_layer: Callable[[int], None] | None = None) -> torch.Tensor:
        """kv_caches: [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim].
        Returns logits (in the model's dtype) for the tokens at logits_indices only. after_layer(i) runs once layer
        i's KV is in the pool (a disaggregated prefill ships it while the next layer computes)."""
        raise NotImplementedError

    def init_buffers(self, device: torch.device | str) -> None:
        """Compute the tables that are not weights (rotary cos/sin) on device, after a meta-device build."""
        raise NotImplementedError

    @staticmethod
    def weight_parts(cfg: ArchConfig) -> dict[str, list[str]]:
        """Each linear module (and embed_tokens) -> the checkpoint tensors (HF names) it is made of:
        q/k/v and gate/up are fused into one matmul each; a tied lm_head is the embedding."""
        parts = {"embed_tokens": ["embed_tokens.weight"],
                 "lm_head": ["embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"]}
        for i in range(cfg.num_layers):
            pre = f"layers.{i}."
            parts[f"{pre}self_attn.qkv_proj"] = [f"{pre}self_attn.{p}_proj.weight" for p in "qkv"]
            parts[f"{pre}self_attn.o_proj"] = [f"{pre}self_attn.o_proj.weight"]
            parts[f"{pre}mlp.gate_up_proj"] = [f"{pre}mlp.gate_proj.weight", f"{pre}mlp.up_proj.weight"]
            parts[f"{pre}mlp.down_proj"] = [f"{pre}mlp.down_proj.weight"]
        return parts

    @staticmethod
    def expert_parts(cfg: ArchConfig) -> dict[str, list[str]]:
        """Each mixture-of-experts layer's expert stacks (model/moe.py's w13, w2) -> the per-expert
        checkpoint tensors they hold, so the loader plans how they are held as it does a linear's
        (none for a dense model)."""
        return {}

    def load_weights(self, weights: Mapping[str, Weight]) -> None:
        """Take HF-named tensors (q/k/v and gate/up separate; dense or quantized) into this layout."""
        weights = {k.removeprefix("model."): v for k, v in weights.items()}
        missing: list[str] = []
        used: set[str] = set()
        modules = dict(self.named_modules())
        for name, parts in self.weight_parts(self.cfg).items():
            layer = modules[name]
            linear = layer.table if isinstance(layer, Embedding) else layer
            if not all(p in weights for p in parts):
                missing.append(name)
                continue
            used.update(parts)
            if name == "lm_head" and self.cfg.tie_word_embeddings:
                self._tie_head()
                continue
            try:
                linear.method.load(linear, [weights[p] for p in parts])
            except ValueError as e:
                raise ValueError(f"weight {name}: {e}") from e
            if linear.bias is not None:
                biases = [p.replace(".weight", ".bias") for p in parts]
                if not all(b in weights for b in biases):
                    missing.append(f"{name}.bias")
                    continue
                used.update(biases)
                linear.bias.data.copy_(torch.cat([weights[b] for b in biases]))
        linears = {id(m) for m in modules.values() if isinstance(m, Linear)}
        for name, param in self.named_parameters():
            owner = modules[name.rsplit(".", 1)[0]]
            if id(owner) in linears:
                continue  # loaded above
            if name not in weights:
                missing.append(name)
                continue
            if weights[name].shape != param.shape:
                raise ValueError(f"weight {name} has shape {tuple(weights[name].shape)}, expected {tuple(param.shape)}")
            param.data.copy_(weights[name])
            used.add(name)
        if missing:
            raise ValueError(f"checkpoint lacks weights: {missing[:5]}{' ...' if len(missing) > 5 else ''}")
        # A tensor nothing reads is a part of the architecture not built (a bias, a norm): refused, not
        # dropped. Rotary tables some checkpoints save, and a tied model's stored head, are not weights.
        ignored = ("rotary_emb.inv_freq",) + (("lm_head.weight",) if self.cfg.tie_word_embeddings else ())
        unused = sorted(k for k in weights if k not in used and not k.endswith(ignored))
        if unused:
            raise ValueError(f"checkpoint has weights this model does not use: {unused[:5]}"
                             f"{' ...' if len(unused) > 5 else ''}")
        for m in self.modules():
            if isinstance(m, Linear):
                m.method.finish(m)
        if self.cfg.tie_word_embeddings:
            self.embed_tokens.share_head(self.lm_head)

    def _tie_head(self) -> None:
        """The lm_head reads the embedding's own storage (plan_linear_methods gives a quantized table's
        head the same format; a dense table's head may pack its own copy)."""
        table = self.embed_tokens.table
        if hasattr(table, "qdata"):
            self.lm_head.qdata = table.qdata
        else:
            self.lm_head.weight = table.weight
