"""Compiled CPU ops (``torch.ops.tandem``, built by ``tandem.ops.extension``) with PyTorch fallbacks."""
