"""Rotary position embeddings' frequencies: the base, and how a checkpoint rescales them.

A model's rotary table (model/layers.py RotaryEmbedding) rotates each pair of dimensions i at
position p by p * inv_freq[i], inv_freq[i] = theta ** (-2i / head_dim), divided by a per-pair factor
where the checkpoint scales its context:
  default   no factors;
  linear    every pair by `factor` (positions divided by it; Gemma 3's global layers);
  llama3    Llama 3.1+'s: pairs whose wavelength is shorter than original_max / high_freq_factor keep
            theirs, those longer than original_max / low_freq_factor are divided by `factor`, and the
            ones between blend the two (transformers' _compute_llama3_parameters, and the factors
            llama.cpp's converter writes as the `rope_freqs` tensor of a GGUF file);
  yarn      YaRN (Qwen2.5's long context): a linear ramp between the pairs that rotate more than
            beta_fast times over the original context (kept) and those that rotate less than
            beta_slow times (divided by `factor`), and cos / sin scaled by an attention factor
            (0.1 ln(factor) + 1 unless given; transformers' _compute_yarn_parameters);
  longrope  Phi-3/4's: each pair's own divisor, the long list when the deployment's context exceeds
            the original one and the short list otherwise, and cos / sin scaled by
            sqrt(1 + ln(factor) / ln(original)) (transformers' _compute_longrope_parameters);
  dynamic   dynamic NTK: the base raised for contexts past max_position_embeddings
            (transformers' _compute_dynamic_ntk_parameters).
Longrope and dynamic NTK depend on a length. transformers takes the current sequence's; here it is the
deployment's context (--max-model-len, else the model's), as llama.cpp takes its context size: the
factors are fixed per deployment, so a cached key means the same for every request.

A checkpoint may rotate only the first rotary_dim dimensions of each head (partial_rotary_factor:
Phi-4-mini, GPT-NeoX); the frequencies are then over rotary_dim, and the rest pass through.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch


def inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    """float32 [head_dim / 2], on the CPU."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=torch.device("cpu")).float() / head_dim
    return 1.0 / (theta ** exponents)


def llama3_factors(head_dim: int, theta: float, factor: float, low_freq_factor: float, high_freq_factor: float,
                   original_max_position: int) -> tuple[float, ...]:
    """Each pair's divisor of its frequency under Llama 3's scaling."""
    low_wavelen = original_max_position / low_freq_factor
    high_wavelen = original_max_position / high_freq_factor
    out = []
    for f in inv_freq(head_dim, theta).tolist():
        wavelen = 2 * math.pi / f
        if wavelen < high_wavelen:
            out.append(1.0)
        elif wavelen > low_wavelen:
            out.append(factor)
        else:
            smooth = (original_max_position / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            out.append(1.0 / ((1 - smooth) / factor + smooth))
    return tuple(out)


def yarn(head_dim: int, theta: float, params: dict[str, Any], max_position: int) -> tuple[tuple[float, ...], float]:
    """(each pair's divisor, the attention factor) under YaRN."""
    original = int(params.get("original_max_position_embeddings") or max_position)
    factor = float(params.get("factor") or max_position / original)

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention = params.get("attention_factor")
    if attention is None:
        m, m_all = params.get("mscale"), params.get("mscale_all_dim")
        attention = mscale(factor, m) / mscale(factor, m_all) if m and m_all else mscale(factor)
    fast, slow = float(params.get("beta_fast") or 32), float(params.get("beta_slow") or 1)

    def correction(rotations: float) -> float:  # the pair index that rotates this many times over `original`
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction(fast), correction(slow)
    if params.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # the share of a pair's own frequency (the rest is divided by the factor)
    base = inv_freq(head_dim, theta)
    scaled = base / factor * (1 - keep) + base * keep
    return tuple((base / scaled).tolist()), float(attention)


def longrope(long: list[float], short: list[float], original: int, max_position: int, context: int,
             factor: float | None = None, attention: float | None = None) -> tuple[tuple[float, ...], float]:
    """(each pair's divisor, the attention factor) under longrope for a deployment of this context."""
    factor = factor or max_position / original
    if attention is None:
        attention = math.sqrt(1 + math.log(factor) / math.log(original)) if factor > 1 else 1.0
    return tuple(float(f) for f in (long if context > original else short)), float(attention)


def dynamic_ntk_theta(theta: float, factor: float, rotary_dim: int, max_position: int, context: int) -> float:
    """The base under dynamic NTK for a deployment of this context (unchanged within max_position)."""
    seq = max(context, max_position)
    return theta * ((factor * seq / max_position) - (factor - 1)) ** (rotary_dim / (rotary_dim - 2))


@dataclass(frozen=True)
class Rope:
    theta: float
    linear_factor: float = 1.0
    freq_factors: tuple[float, ...] = ()  # each pair's divisor
    attention_factor: float = 1.0  # cos and sin scaled by it (YaRN, longrope)
    rotary_dim: int = 0  # the dimensions of each head rotated (the first ones); 0: all of head_dim


def rope_from_hf(cfg: dict[str, Any], head_dim: int, context: int | None = None) -> Rope:
    """A config.json's RoPE: transformers 4's rope_scaling or 5's rope_parameters, for a deployment of
    `context` tokens (None: max_position_embeddings). NotImplementedError for a scaling not built yet."""
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    theta = float(cfg.get("rope_theta", params.get("rope_theta", 10000.0)))
    partial = float(params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)))
    dim = int(head_dim * partial)
    if dim % 2 or not 0 < dim <= head_dim:
        raise NotImplementedError(f"partial_rotary_factor {partial} gives {dim} rotary dimensions of {head_dim}")
    rotary_dim = dim if dim < head_dim else 0
    max_position = int(cfg.get("max_position_embeddings", 4096))
    context = context or max_position
    if kind == "default":
        return Rope(theta, rotary_dim=rotary_dim)
    if kind == "linear":
        return Rope(theta, float(params["factor"]), rotary_dim=rotary_dim)
    if kind == "llama3":
        return Rope(theta, freq_factors=llama3_factors(
            dim, theta, float(params["factor"]), float(params.get("low_freq_factor", 1.0)),
            float(params.get("high_freq_factor", 4.0)), int(params["original_max_position_embeddings"])),
            rotary_dim=rotary_dim)
    if kind == "yarn":
        factors, attention = yarn(dim, theta, params, max_position)
        return Rope(theta, freq_factors=factors, attention_factor=attention, rotary_dim=rotary_dim)
    if kind in ("longrope", "su"):
        original = int(params.get("original_max_position_embeddings") or cfg["original_max_position_embeddings"])
        factors, attention = longrope(params["long_factor"], params["short_factor"], original, max_position, context,
                                      params.get("factor"), params.get("attention_factor"))
        if len(factors) != dim // 2:
            raise ValueError(f"longrope lists {len(factors)} factors for {dim // 2} rotary pairs")
        return Rope(theta, freq_factors=factors, attention_factor=attention, rotary_dim=rotary_dim)
    if kind == "dynamic":
        return Rope(dynamic_ntk_theta(theta, float(params["factor"]), dim, max_position, context),
                    rotary_dim=rotary_dim)
    raise NotImplementedError(f"rope scaling {kind!r} is not supported yet")


def rope_from_gguf(meta: dict[str, Any], arch: str, head_dim: int, max_position: int,
                   yarn_truncate: bool = True) -> Rope:
    """A GGUF file's RoPE from its `<arch>.rope.*` metadata, as llama.cpp's converter writes a config's
    scaling (`rope.scaling.type` linear or yarn, `.factor`, `.original_context_length`, `.attn_factor`,
    `.yarn_beta_fast` / `.yarn_beta_slow`; `rope.dimension_count` narrower than a head: partial rotary);
    Llama 3's comes as the rope_freqs tensor, longrope's as rope_factors_long / _short (loader.py,
    gguf_longrope). yarn_truncate: whether YaRN's ramp ends are rounded to whole pairs, which GGUF
    does not record (transformers' `truncate`; gpt-oss was trained without it)."""
    theta = float(meta.get(f"{arch}.rope.freq_base", 10000.0))
    dim = int(meta.get(f"{arch}.rope.dimension_count") or head_dim)
    rotary_dim = dim if dim < head_dim else 0
    key = f"{arch}.rope.scaling."
    kind = str(meta.get(key + "type", "none"))
    if kind == "none":
        return Rope(theta, rotary_dim=rotary_dim)
    factor = float(meta.get(key + "factor", 1.0))
    if kind == "linear":
        return Rope(theta, factor, rotary_dim=rotary_dim)
    if kind == "yarn":
        params = {"factor": factor, "original_max_position_embeddings": meta.get(key + "original_context_length"),
                  "attention_factor": meta.get(key + "attn_factor"), "beta_fast": meta.get(key + "yarn_beta_fast"),
                  "beta_slow": meta.get(key + "yarn_beta_slow"), "truncate": yarn_truncate}
        factors, attention = yarn(dim, theta, params, max_position)
        return Rope(theta, freq_factors=factors, attention_factor=attention, rotary_dim=rotary_dim)
    raise NotImplementedError(f"rope scaling {kind!r} is not supported yet")


def gguf_longrope(meta: dict[str, Any], arch: str, long: list[float], short: list[float], max_position: int,
                  context: int | None) -> tuple[tuple[float, ...], float]:
    """(divisors, attention factor) from the rope_factors_long / _short tensors llama.cpp's converter
    writes for longrope (Phi-3/4), with its `rope.scaling.attn_factor` and original context."""
    original = int(meta.get(f"{arch}.rope.scaling.original_context_length") or max_position)
    return longrope(long, short, original, max_position, context or max_position,
                    attention=meta.get(f"{arch}.rope.scaling.attn_factor"))
