"""A tiny random Llama with the default model's tokenizer, served like any Hugging Face directory: for
the tests of the cluster's protocols (routing, transfers, kills, migration), whose checks are about
where tokens and KV go, not what the model says. Its steps take a millisecond where the default
model's take tens, so those tests time their processes, not the model.

Built once per machine and version (seeded: the same weights every run) into the temp directory,
atomically, so parallel or repeated sessions share it."""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

VERSION = 2


def tiny_served_model() -> Path:
    path = Path(tempfile.gettempdir()) / f"tandem-tests-{os.getuid()}" / f"tiny-llama-v{VERSION}"
    if (path / "config.json").exists():
        return path
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from tandem.model_path import default_model_path
    from tandem.tokenizer import load_gguf_tokenizer

    tokenizer = load_gguf_tokenizer(default_model_path())
    assert tokenizer is not None
    cfg = LlamaConfig(vocab_size=len(tokenizer), hidden_size=96, intermediate_size=192, num_hidden_layers=2,
                      num_attention_heads=6, num_key_value_heads=3, max_position_embeddings=8192,
                      tie_word_embeddings=True, initializer_range=0.1, bos_token_id=tokenizer.bos_token_id,
                      eos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=path.parent))
    model.save_pretrained(staging, safe_serialization=True)
    tokenizer.save_pretrained(staging)
    with contextlib.suppress(OSError):  # another session built it first
        staging.rename(path)
    return path
