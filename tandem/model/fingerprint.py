"""A model's fingerprint: part of every KV block's key, so equal keys mean equal KV on any host.

Two processes serving the same weights in the same dtype get the same value; another checkpoint,
a fine-tune of the same architecture, or another dtype gets another. Hashing every weight byte
would cost a second per GiB at start-up, so each tensor contributes its name, shape, dtype and an
evenly strided sample of its values: any realistic difference between checkpoints changes them.
"""

from __future__ import annotations

import hashlib

import torch

SAMPLES_PER_TENSOR = 4096


def weights_fingerprint(weights: dict[str, torch.Tensor], dtype: torch.dtype) -> int:
    h = hashlib.sha256(str(dtype).encode())
    for name in sorted(weights):
        t = weights[name].detach()
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype}".encode())
        flat = t.reshape(-1)
        sample = flat[::max(flat.numel() // SAMPLES_PER_TENSOR, 1)].contiguous().cpu()
        h.update(sample.view(torch.uint8).numpy().tobytes())
    return int.from_bytes(h.digest()[:8], "little", signed=True)
