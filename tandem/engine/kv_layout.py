"""The engine's KV pool layout: its cache settings joined with the model's shape (kv/layout.py takes
shapes only, so storage imports nothing of the config's engine or of the model)."""

from __future__ import annotations

from tandem.config import EngineConfig
from tandem.kv.layout import KVLayout, kv_layout
from tandem.model.arch import ArchConfig


def engine_kv_layout(config: EngineConfig, arch: ArchConfig) -> KVLayout:
    return kv_layout(config.cache.kv_cache_dtype, config.model.torch_dtype, arch.head_dim)
