"""What a model holds, by form: the bytes of every weight as its layers hold them (the start-up report,
/metrics, the tests' budget of 1.1x the file), and the linear methods in use."""

from __future__ import annotations

import torch
from torch import nn

from tandem.model.linear import GGUFMethod, Linear


def weight_formats(model: nn.Module) -> tuple[str, ...]:
    """The linear methods a model's layers use, e.g. ("gguf-Q4_1", "gguf-Q8_0")."""
    return tuple(sorted({m.method.name for m in model.modules() if isinstance(m, Linear)}))


def held_forms(model: nn.Module) -> dict[str, int]:
    """Bytes of every weight the model holds, by the form it is held in: a linear method's name (its
    weight or ggml blocks), "packed-bf16 panels" and "packed-bf16 oneDNN" for the two copies a packed
    layer can keep, "<method> experts" for a mixture of experts' stacks, "other" for the rest (norms).
    Each storage is counted once, so a tied head is counted once. Other buffers are computed tables, not
    weights (the rotary cos/sin, Gemma 3's local table too)."""
    seen: set[int] = set()
    forms: dict[str, int] = {}

    def count(form: str, t: torch.Tensor) -> None:
        if t.is_mkldnn:  # oneDNN's packed layout: an opaque tensor of its own, with no storage to share
            nbytes = t.numel() * t.element_size()
        else:
            ptr = t.untyped_storage().data_ptr()
            if ptr in seen:
                return
            seen.add(ptr)
            nbytes = t.untyped_storage().nbytes()
        forms[form] = forms.get(form, 0) + nbytes

    linears = [m for m in model.modules() if isinstance(m, Linear)]
    # A tied head that interleaved the blocks it shares with the embedding's table names their form.
    linears.sort(key=lambda m: not (isinstance(m.method, GGUFMethod) and m.method.interleave))
    for m in linears:
        for name, t in m.named_buffers():
            part = {"packed.panels": " panels", "packed.packed_weight": " oneDNN"}.get(name, "")
            count(m.method.name + part, t)
        for t in m.parameters():
            count(m.method.name, t)
    for m in model.modules():  # a mixture of experts' stacks, by their form (model/moe.py)
        for form, t in getattr(m, "held_stacks", lambda: [])():
            count(form, t)
    for t in model.parameters():
        count("other", t)
    return forms


def weight_bytes(model: nn.Module) -> int:
    """Bytes of every weight the model holds (held_forms, summed)."""
    return sum(held_forms(model).values())
