"""A model's fingerprint: part of every KV block's key, so equal keys mean equal KV on any host.

Two processes serving the same weights in the same dtype get the same value; another checkpoint,
a fine-tune of the same architecture, or another dtype gets another. Hashing every weight byte
would cost a second per GiB at start-up, so each tensor contributes its name, shape, dtype and an
evenly strided sample of its values: any realistic difference between checkpoints changes them.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

import torch

from tandem.model.quant import QuantizedWeight

SAMPLES_PER_TENSOR = 4096


def weights_fingerprint(weights: Mapping[str, torch.Tensor | QuantizedWeight], dtype: torch.dtype) -> int:
    """Weights served as stored blocks (their format in the key) compute other KV than the same file
    dequantized, so the two fingerprints differ."""
    h = hashlib.sha256(str(dtype).encode())
    for name in sorted(weights):
        w = weights[name]
        t = w.data.detach() if isinstance(w, QuantizedWeight) else w.detach()
        kind = w.fmt.name if isinstance(w, QuantizedWeight) else str(t.dtype)
        h.update(f"{name}:{tuple(t.shape)}:{kind}".encode())
        flat = t.reshape(-1)
        sample = flat[::max(flat.numel() // SAMPLES_PER_TENSOR, 1)].contiguous().cpu()
        h.update(sample.view(torch.uint8).numpy().tobytes())
    return int.from_bytes(h.digest()[:8], "little", signed=True)
