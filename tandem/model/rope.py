"""Rotary position embeddings' frequencies: the base, and how a checkpoint rescales them.

A model's rotary table (model/layers.py RotaryEmbedding) rotates each pair of dimensions i at
position p by p * inv_freq[i], inv_freq[i] = theta ** (-2i / head_dim), divided by a per-pair factor
where the checkpoint scales its context:
  default   no factors;
  linear    every pair by `factor` (positions divided by it; Gemma 3's global layers);
  llama3    Llama 3.1+'s: pairs whose wavelength is shorter than original_max / high_freq_factor keep
            theirs, those longer than original_max / low_freq_factor are divided by `factor`, and the
            ones between blend the two (transformers' _compute_llama3_parameters, and the factors
            llama.cpp's converter writes as the `rope_freqs` tensor of a GGUF file).
The factors are fixed per model, so a cached key means the same for every request.
"""

from __future__ import annotations

import math
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


def rope_from_hf(cfg: dict[str, Any], head_dim: int) -> tuple[float, float, tuple[float, ...]]:
    """(theta, linear factor, per-pair factors) from a config.json: transformers 4's rope_scaling or
    5's rope_parameters. NotImplementedError for a scaling not built yet."""
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    kind = params.get("rope_type", params.get("type", "default")) or "default"
    theta = float(cfg.get("rope_theta", params.get("rope_theta", 10000.0)))
    if kind == "default":
        return theta, 1.0, ()
    if kind == "linear":
        return theta, float(params["factor"]), ()
    if kind == "llama3":
        return theta, 1.0, llama3_factors(head_dim, theta, float(params["factor"]),
                                          float(params.get("low_freq_factor", 1.0)),
                                          float(params.get("high_freq_factor", 4.0)),
                                          int(params["original_max_position_embeddings"]))
    raise NotImplementedError(f"rope scaling {kind!r} is not supported yet")
