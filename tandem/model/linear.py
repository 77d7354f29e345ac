"""The linear-method seam: how each linear layer holds its weight and which kernel multiplies by it.

The loader reads the checkpoint first and then plans a method per layer (plan_linear_methods), so the
model is built with every layer in its final form: no module is swapped after loading.

  dense       a [out, in] weight in the model's dtype, F.linear
  packed-bf16 the same weight packed once for oneDNN (and small_batch_linear's panels) on CPUs with
              native bf16 (model/packed_linear.py)
  gguf        ggml blocks as stored in the file (model/block_formats.py: Q4_0, Q4_1, Q5_0, Q8_0, Q4_K,
              Q5_K, Q6_K, MXFP4), model/quant.py's kernels, with activations in float (gguf) or rounded
              to int8 per block of 32 (gguf-q8, llama.cpp's)
  gguf-split  a fused layer whose parts the file holds in different formats (a Q4_K_M file's q and k
              in Q4_K, v in Q6_K): each run of parts in one format as its own blocks, the outputs side
              by side
With int8 activations on a CPU with AVX512-VNNI, Q4_K, Q6_K, Q4_0 and Q8_0 blocks are interleaved by 16
rows once loaded (in place: the same bytes, permuted), the layout ops/quant_linear_x16.cpp's kernel streams.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from tandem.model.block_formats import INTERLEAVED16_FORMATS, BlockFormat
from tandem.model.packed_linear import SMALL_BATCH_ROWS, PackedLinear, packing_supported
from tandem.model.quant import UNLIMITED_ROWS, QuantizedWeight, gemm_rows, quantized_linear, slice_weight
from tandem.ops import extension

log = logging.getLogger(__name__)

Weight = torch.Tensor | QuantizedWeight


def weight_rows(w: Weight, start: int, end: int) -> Weight:
    """Output rows [start, end) of a weight, dense or still in its blocks."""
    return slice_weight(w, rows=(start, end)) if isinstance(w, QuantizedWeight) else w[start:end]


@dataclass(frozen=True)
class NativeLinear:
    """How the native layer stack (ops/layer_stack.cpp) multiplies by a layer's weight: its kind
    (0 dense, 1 small_batch_linear panels, 2 ggml blocks, 3 ggml blocks with int8 activations,
    4 oneDNN's packed copy, 5 parts side by side), the
    tensor it reads, and the most rows that form serves (0: any); past them, wide (oneDNN's packed
    copy of a panelled weight) serves."""

    kind: int
    weight: torch.Tensor
    qtype: int = 0
    max_rows: int = 0
    wide: torch.Tensor | None = None
    out_features: int = 0  # a part's rows (gguf-split's parts; 0: the layer's)
    parts: tuple[NativeLinear, ...] = ()  # gguf-split: these forms' outputs side by side (kind and weight unused)


def dense(weight: Weight) -> torch.Tensor:
    return weight.dequantize() if isinstance(weight, QuantizedWeight) else weight


class LinearMethod:
    """Dense: the weight as a Parameter in the model's dtype."""

    name = "dense"

    def create(self, layer: Linear) -> None:
        layer.weight = nn.Parameter(torch.empty(layer.out_features, layer.in_features, dtype=layer.dtype),
                                    requires_grad=False)

    def load(self, layer: Linear, parts: Sequence[Weight]) -> None:
        layer.check_shape((sum(int(p.shape[0]) for p in parts), int(parts[0].shape[1])))
        self.fill(layer.weight.data, parts)

    def fill(self, dest: torch.Tensor, parts: Sequence[Weight]) -> None:
        """The parts' rows one after another into dest, as this method holds them (here: dense). Also
        how a mixture of experts fills a slot of its stacks (model/qwen3_moe.py)."""
        row = 0
        for p in parts:
            t = dense(p)
            dest[row:row + t.shape[0]].copy_(t)
            row += t.shape[0]

    def finish(self, layer: Linear) -> None:
        """Once the weights are in (packing, repacking)."""

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, layer.weight, layer.bias)

    def native_form(self, layer: Linear) -> NativeLinear | None:
        """This layer's form for the native layer stack; None: it has none (the Python path serves it)."""
        return NativeLinear(0, layer.weight) if isinstance(layer.weight, torch.Tensor) else None


class PackedBf16Method(LinearMethod):
    name = "packed-bf16"

    def finish(self, layer: Linear) -> None:
        layer.packed = PackedLinear(layer.weight, layer.bias)
        layer.weight = None  # the packed copy replaces it (a tied embedding keeps its own)

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        return layer.packed(x)

    def native_form(self, layer: Linear) -> NativeLinear | None:
        packed = layer.packed
        if packed.panels is None:  # no bf16 dot-product kernel here: every row goes to oneDNN's copy
            return NativeLinear(4, packed.packed_weight)
        return NativeLinear(1, packed.panels, max_rows=SMALL_BATCH_ROWS or 0, wide=packed.packed_weight)


def interleavable(fmt: BlockFormat, rows: int) -> bool:
    """Whether rows of fmt's blocks can be held interleaved by 16 for the int8 kernel on this CPU."""
    return (rows % 16 == 0 and fmt in INTERLEAVED16_FORMATS and extension.extension_available()
            and bool(torch.ops.tandem.gguf_interleave16_supported(fmt.ggml_type)))


@dataclass(frozen=True)
class GGUFMethod(LinearMethod):
    fmt: BlockFormat  # the file's format: what load takes
    int8_activations: bool = False
    interleave: bool = False  # held interleaved by 16 rows once loaded (finish): held_fmt

    @property
    def held_fmt(self) -> BlockFormat:
        return INTERLEAVED16_FORMATS[self.fmt] if self.interleave else self.fmt

    @property
    def name(self) -> str:  # type: ignore[override]
        return f"gguf-{self.held_fmt.name}" + ("-a8" if self.int8_activations else "")

    def create(self, layer: Linear) -> None:
        layer.register_buffer("qdata", torch.empty(layer.out_features, self.fmt.row_bytes(layer.in_features),
                                                   dtype=torch.uint8))

    def load(self, layer: Linear, parts: Sequence[Weight]) -> None:
        """Each part's blocks straight into their rows of the layer's buffer: the one copy of the file's
        bytes this process holds (the parts may be views of the mapped file)."""
        if any(isinstance(p, QuantizedWeight) and p.in_features != layer.in_features for p in parts):
            raise ValueError("cannot fuse quantized weights of different widths")
        layer.check_shape((sum(int(p.shape[0]) for p in parts), layer.in_features))
        self.fill(layer.qdata, parts)

    def fill(self, dest: torch.Tensor, parts: Sequence[Weight]) -> None:
        row = 0
        for p in parts:
            if not (isinstance(p, QuantizedWeight) and p.fmt == self.fmt):
                raise ValueError(f"{self.name} expects {self.fmt.name} weights")
            dest[row:row + p.out_features].copy_(p.data)
            row += p.out_features

    def finish(self, layer: Linear) -> None:
        self.interleave_blocks(layer.qdata, layer.in_features)

    def interleave_blocks(self, blocks: torch.Tensor, in_features: int) -> None:
        if self.interleave:
            torch.ops.tandem.gguf_interleave16_(blocks, self.fmt.ggml_type, in_features)

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        return quantized_linear(x, layer.quantized_weight(), layer.bias, self.int8_activations)

    def native_form(self, layer: Linear) -> NativeLinear | None:
        return self.native_form_of(layer.qdata)

    def native_form_of(self, blocks: torch.Tensor) -> NativeLinear:
        # Float activations: past gemm_rows quantized_linear dequantizes for a GEMM, the Python path's job.
        # int8: the kernel at every row count (quantized_linear).
        rows = UNLIMITED_ROWS if self.int8_activations else gemm_rows()
        return NativeLinear(3 if self.int8_activations else 2, blocks, self.held_fmt.ggml_type, rows)


@dataclass(frozen=True)
class SplitGGUFMethod(LinearMethod):
    """A fused layer whose parts are in different block formats, each run of one format held as its
    own blocks (never dequantized): groups are (format, rows) in the fused order."""

    groups: tuple[tuple[BlockFormat, int], ...]
    int8_activations: bool = False
    interleave: tuple[bool, ...] = ()  # per group: held interleaved by 16 rows (GGUFMethod.interleave)

    def group_methods(self) -> list[GGUFMethod]:
        flags = self.interleave or (False,) * len(self.groups)
        return [GGUFMethod(fmt, self.int8_activations, il) for (fmt, _), il in zip(self.groups, flags, strict=True)]

    @property
    def name(self) -> str:  # type: ignore[override]
        return ("gguf-split-" + "+".join(m.held_fmt.name for m in self.group_methods())
                + ("-a8" if self.int8_activations else ""))

    def create(self, layer: Linear) -> None:
        if sum(rows for _, rows in self.groups) != layer.out_features:
            raise ValueError(f"{self.name}: the groups' rows are not the layer's {layer.out_features}")
        for i, (fmt, rows) in enumerate(self.groups):
            layer.register_buffer(f"qdata{i}", torch.empty(rows, fmt.row_bytes(layer.in_features), dtype=torch.uint8))

    def blocks(self, layer: Linear, as_held: bool = True) -> list[QuantizedWeight]:
        """Each group's blocks, in the format they are held in (as_held) or the file's."""
        return [QuantizedWeight(getattr(layer, f"qdata{i}"), m.held_fmt if as_held else m.fmt, layer.in_features)
                for i, m in enumerate(self.group_methods())]

    def load(self, layer: Linear, parts: Sequence[Weight]) -> None:
        """Each run of parts into its group's blocks (GGUFMethod.fill checks the format)."""
        if any(isinstance(p, QuantizedWeight) and p.in_features != layer.in_features for p in parts):
            raise ValueError("cannot fuse quantized weights of different widths")
        queue = list(parts)
        for held in self.blocks(layer, as_held=False):
            row = 0
            while row < held.out_features:
                if not queue:
                    raise ValueError(f"{self.name}: fewer parts than its groups hold")
                p = queue.pop(0)
                GGUFMethod(held.fmt).fill(held.data[row:], [p])
                row += int(p.shape[0])
        if queue:
            raise ValueError(f"{self.name}: more parts than its groups hold")

    def finish(self, layer: Linear) -> None:
        for i, m in enumerate(self.group_methods()):
            m.interleave_blocks(getattr(layer, f"qdata{i}"), layer.in_features)

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        out = torch.cat([quantized_linear(x, w, None, self.int8_activations) for w in self.blocks(layer)], dim=-1)
        return out if layer.bias is None else out + layer.bias

    def native_form(self, layer: Linear) -> NativeLinear | None:
        forms = tuple(replace(m.native_form_of(w.data), out_features=rows)
                      for m, w, (_, rows) in zip(self.group_methods(), self.blocks(layer), self.groups, strict=True))
        return NativeLinear(5, forms[0].weight, max_rows=min(f.max_rows for f in forms), parts=forms)


def format_groups(parts: Sequence[Weight]) -> tuple[tuple[BlockFormat, int], ...] | None:
    """Runs of consecutive parts in one block format as (format, rows); None unless every part is blocks."""
    if not all(isinstance(p, QuantizedWeight) for p in parts):
        return None
    groups: list[tuple[BlockFormat, int]] = []
    for p in parts:
        assert isinstance(p, QuantizedWeight)
        if groups and groups[-1][0] == p.fmt:
            groups[-1] = (p.fmt, groups[-1][1] + p.out_features)
        else:
            groups.append((p.fmt, p.out_features))
    return tuple(groups)


DENSE = LinearMethod()


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype,
                 method: LinearMethod = DENSE) -> None:
        super().__init__()
        self.in_features, self.out_features, self.dtype, self.method = in_features, out_features, dtype, method
        method.create(self)
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype), requires_grad=False) if bias else None
        # A row-parallel layer's output is this rank's partial sum: reduce sums it over the worker
        # group (model/tensor_parallel.py; set by CausalLM.join_group).
        self.reduce: Callable[[torch.Tensor], torch.Tensor] | None = None

    def check_shape(self, shape: tuple[int, ...]) -> None:
        if tuple(shape) != (self.out_features, self.in_features):
            raise ValueError(f"weight has shape {tuple(shape)}, expected {(self.out_features, self.in_features)}")

    def quantized_weight(self) -> QuantizedWeight:
        assert isinstance(self.method, GGUFMethod)
        return QuantizedWeight(self.qdata, self.method.held_fmt, self.in_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.method.apply(self, x)
        return out if self.reduce is None else self.reduce(out)

    def extra_repr(self) -> str:
        return f"{self.in_features} -> {self.out_features}, {self.method.name}"


def native_dtype_method(dtype: torch.dtype, device: torch.device) -> LinearMethod:
    """The method for a weight held in the model's dtype."""
    return PackedBf16Method() if packing_supported(device, dtype) else DENSE


def plan_linear_methods(layer_parts: Mapping[str, Sequence[str]], weights: Mapping[str, Weight],
                        dtype: torch.dtype, device: torch.device, int8_activations: bool = False,
                        interleavable_layers: Collection[str] = ()) -> dict[str, LinearMethod]:
    """Per linear layer (by module name, from the checkpoint tensors it is made of): the file's own
    block format when every part has it, each run of parts in its own format when every part is in a
    block format but not the same one (gguf-split), else the model's dtype. With int8 activations, the
    blocks of interleavable_layers (the model's own Linear modules: not the embedding, which looks rows
    up, nor a mixture's expert stacks) are held interleaved where this CPU's kernel reads that layout."""
    plan: dict[str, LinearMethod] = {}
    fallback = native_dtype_method(dtype, device)
    for layer, parts in layer_parts.items():
        present = [weights[p] for p in parts if p in weights]
        formats = {w.fmt if isinstance(w, QuantizedWeight) else None for w in present}
        fmt = next(iter(formats)) if len(formats) == 1 else None
        groups = format_groups(present) if present and len(present) == len(parts) else None
        # F.embedding needs the plain table; a tied head packs its own copy.
        may_interleave = int8_activations and layer in interleavable_layers and layer != "embed_tokens"
        if fmt is not None:
            rows = sum(int(w.shape[0]) for w in present)
            plan[layer] = GGUFMethod(fmt, int8_activations, may_interleave and interleavable(fmt, rows))
        elif groups is not None and layer != "embed_tokens":
            flags = tuple(may_interleave and interleavable(f, rows) for f, rows in groups)
            plan[layer] = SplitGGUFMethod(groups, int8_activations, flags if any(flags) else ())
        else:
            plan[layer] = DENSE if layer == "embed_tokens" else fallback
            if any(f is not None for f in formats):
                log.info("%s mixes %s: dequantized", layer, sorted(f.name if f else "dense" for f in formats))
    return plan


class Embedding(nn.Module):
    """Token embeddings, dense or as the file's blocks (the rows a step looks up are dequantized).
    first_id: the first token id of the rows held (tensor parallelism splits the vocabulary: ids
    outside the rows embed as zeros here, and reduce sums the ranks' rows)."""

    def __init__(self, num_embeddings: int, dim: int, dtype: torch.dtype, method: LinearMethod = DENSE,
                 first_id: int = 0) -> None:
        super().__init__()
        self.table = Linear(dim, num_embeddings, bias=False, dtype=dtype, method=method)
        self.head_panels: torch.Tensor | None = None
        self.head_fmt: BlockFormat | None = None  # a tied head's interleaved format, which the table now holds
        self.first_id = first_id
        self.reduce: Callable[[torch.Tensor], torch.Tensor] | None = None

    def share_head(self, head: Linear) -> None:
        """A tied head packed into small_batch_linear's panels holds the table already: rows are read
        from the panels and the plain table is dropped (one copy of the weight, not two)."""
        packed = getattr(head, "packed", None)
        if packed is not None and packed.panels is not None and self.table.method is DENSE:
            self.head_panels = packed.panels
            self.table.weight = None
        # A head that interleaved the blocks it shares with the table: rows are read back out of that layout.
        if isinstance(head.method, GGUFMethod) and head.method.interleave:
            self.head_fmt = head.method.held_fmt

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.reduce is None:
            return self.lookup(ids)
        local = ids - self.first_id
        held = (local >= 0) & (local < self.table.out_features)
        rows = self.lookup(torch.where(held, local, 0))
        return self.reduce(rows * held.unsqueeze(-1).to(rows.dtype))

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        t = self.table
        if self.head_panels is not None:  # [P, K/2, 32, 2]: row 32p + j is [p, :, j, :]
            flat = ids.reshape(-1)
            rows = self.head_panels[flat // 32, :, flat % 32, :]
            return rows.reshape(*ids.shape, t.in_features)
        if isinstance(t.method, GGUFMethod):
            flat = ids.reshape(-1)
            blocks = (t.qdata[flat] if self.head_fmt is None else
                      torch.ops.tandem.gguf_deinterleave16(t.qdata, self.head_fmt.ggml_type, t.in_features, flat))
            rows = QuantizedWeight(blocks, t.method.fmt, t.in_features)
            return rows.dequantize().to(t.dtype).view(*ids.shape, t.in_features)
        return F.embedding(ids, t.weight)

