"""ggml's block formats that Tandem serves as stored, and their dequantization in PyTorch.

A row of a weight is blocks along K: 32 weights each (Q4_0, Q4_1, Q5_0, Q8_0, MXFP4), or a K-quant
super-block of 256 (Q4_K, Q5_K, Q6_K: eight sub-blocks of 32, each with its own scale). Every format
reads the same way (as the kernels read it, tandem/ops/gguf_blocks.h): each group of weights is
w = d * q + m with its own d and m (a block of 32, a sub-block, or Q6_K's 16 weights), q an integer
decoded from the block's bits. The values are gguf-py's to the bit: each d * q is exact in float32
and only the K-quants' + m rounds, once, as gguf-py's d * q - dm does.

The PyTorch decoding here is the fallback wherever the compiled kernels do not run (another device,
TANDEM_DISABLE_KERNELS=1), and the tests' second opinion on the kernels.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class BlockFormat:
    name: str
    ggml_type: int  # gguf.GGMLQuantizationType's value
    block_weights: int  # weights along K per block
    block_bytes: int

    @property
    def bits_per_weight(self) -> float:
        return 8 * self.block_bytes / self.block_weights

    def row_bytes(self, in_features: int) -> int:
        """Bytes of one row of in_features weights."""
        if in_features <= 0 or in_features % self.block_weights:
            raise ValueError(f"{self.name} rows hold a multiple of {self.block_weights} weights, not {in_features}")
        return in_features // self.block_weights * self.block_bytes


Q4_0 = BlockFormat("Q4_0", 2, 32, 18)
Q4_1 = BlockFormat("Q4_1", 3, 32, 20)
Q5_0 = BlockFormat("Q5_0", 6, 32, 22)
Q8_0 = BlockFormat("Q8_0", 8, 32, 34)
Q4_K = BlockFormat("Q4_K", 12, 256, 144)
Q5_K = BlockFormat("Q5_K", 13, 256, 176)
Q6_K = BlockFormat("Q6_K", 14, 256, 210)
MXFP4 = BlockFormat("MXFP4", 39, 32, 17)  # an E8M0 exponent and 32 E2M1 codes (gpt-oss's experts)
NATIVE_FORMATS = {f.ggml_type: f for f in (Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q5_K, Q6_K, MXFP4)}
# The same blocks with their bytes permuted within each group of 16 rows at load, for the AVX512-VNNI
# int8 kernel (tandem/ops/quant_linear_x16.cpp): never a file's type, so not in NATIVE_FORMATS. The
# type id is the format's with INTERLEAVED16 set.
INTERLEAVED16 = 1 << 8
INTERLEAVED16_FORMATS = {f: BlockFormat(f"{f.name}_x16", f.ggml_type | INTERLEAVED16, f.block_weights, f.block_bytes)
                         for f in (Q4_0, Q8_0, Q4_K, Q6_K)}


def native_format(ggml_type: int) -> BlockFormat | None:
    """The format if tensors of this ggml type can be served as stored, else None (dequantize them)."""
    return NATIVE_FORMATS.get(int(ggml_type))


# -- decoding: blocks [n, block_bytes] uint8 -> q [n, weights] and d, m [n, scales] --------------------
# (one scale for a block of 32; eight, one a sub-block, for Q4_K and Q5_K; sixteen for Q6_K)

Decoded = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def _half(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """The fp16 at offset of each block, as float32 [n, 1]."""
    return blocks[:, offset:offset + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor, run: int) -> torch.Tensor:
    """Bytes in runs of `run`: each run's low nibbles are `run` weights, then its high nibbles the next."""
    runs = qs.reshape(qs.shape[0], -1, 1, run)
    return torch.cat([runs & 0x0F, runs >> 4], dim=2).reshape(qs.shape[0], -1)


def _bits(qh: torch.Tensor, run: int, width: int) -> torch.Tensor:
    """Fields of `width` bits from the low end of bytes in runs of `run`: run r's bytes give weights
    r * run * (8 / width) on, field f of byte k being weight f * run + k of its run."""
    runs = qh.reshape(qh.shape[0], -1, 1, run)
    shifts = torch.arange(0, 8, width, dtype=torch.uint8).reshape(1, 1, -1, 1)
    return ((runs >> shifts) & ((1 << width) - 1)).reshape(qh.shape[0], -1)


def _k_scales(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K: d and m of each sub-block, from the fp16 d and dmin and the 6-bit scales
    and mins of the eight sub-blocks, packed in bytes 4-15 (ggml's get_scale_min_k4): bytes 0-3 and
    4-7 of them hold sub-blocks 0-3's scales and mins and, in their top two bits, the top bits of
    sub-blocks 4-7's, whose low four bits are bytes 8-11 (scale low nibble, min high nibble)."""
    packed = blocks[:, 4:16].to(torch.int32)
    lo_s, lo_m, hi = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    scale = torch.cat([lo_s & 63, (hi & 0x0F) | ((lo_s >> 6) << 4)], dim=1).float()
    min_ = torch.cat([lo_m & 63, (hi >> 4) | ((lo_m >> 6) << 4)], dim=1).float()
    return _half(blocks, 0) * scale, -(_half(blocks, 2) * min_)


def _decode_q4_0(b: torch.Tensor) -> Decoded:
    d = _half(b, 0)
    return _nibbles(b[:, 2:], 16), d, -8.0 * d


def _decode_q4_1(b: torch.Tensor) -> Decoded:
    return _nibbles(b[:, 4:], 16), _half(b, 0), _half(b, 2)


def _decode_q5_0(b: torch.Tensor) -> Decoded:
    d = _half(b, 0)
    # The high bits are a little-endian word, bit j weight j's: runs of one byte, eight weights each.
    return _nibbles(b[:, 6:], 16) | (_bits(b[:, 2:6], 1, 1) << 4), d, -16.0 * d


def _decode_q8_0(b: torch.Tensor) -> Decoded:
    d = _half(b, 0)
    return b[:, 2:].contiguous().view(torch.int8), d, torch.zeros_like(d)


# E2M1's values doubled, so that they are integers (ggml's kvalues_mxfp4); the scale is halved to match.
MXFP4_VALUES = (0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12)


def _decode_mxfp4(b: torch.Tensor) -> Decoded:
    codes = _nibbles(b[:, 1:], 16).long()
    q = torch.tensor(MXFP4_VALUES, dtype=torch.int8, device=b.device)[codes]
    d = torch.ldexp(torch.ones(b.shape[0], 1, device=b.device), b[:, :1].to(torch.int32) - 128)  # 2^(e - 128)
    return q, d, torch.zeros_like(d)


def _decode_q4_k(b: torch.Tensor) -> Decoded:
    d, m = _k_scales(b)
    return _nibbles(b[:, 16:], 32), d, m


def _decode_q5_k(b: torch.Tensor) -> Decoded:
    d, m = _k_scales(b)
    return _nibbles(b[:, 48:], 32) | (_bits(b[:, 16:48], 32, 1) << 4), d, m


def _decode_q6_k(b: torch.Tensor) -> Decoded:
    q = (_nibbles(b[:, :128], 64) | (_bits(b[:, 128:192], 32, 2) << 4)).to(torch.int8) - 32
    d = _half(b, 208) * b[:, 192:208].contiguous().view(torch.int8).float()
    return q, d, torch.zeros_like(d)


_DECODERS: dict[BlockFormat, Callable[[torch.Tensor], Decoded]] = {
    Q4_0: _decode_q4_0, Q4_1: _decode_q4_1, Q5_0: _decode_q5_0, Q8_0: _decode_q8_0,
    Q4_K: _decode_q4_k, Q5_K: _decode_q5_k, Q6_K: _decode_q6_k, MXFP4: _decode_mxfp4,
}


def torch_dequantize(data: torch.Tensor, fmt: BlockFormat, in_features: int) -> torch.Tensor:
    """uint8 [rows, row bytes] -> float32 [rows, in_features], in PyTorch (any device)."""
    rows = data.shape[0]
    if data.shape[-1] != fmt.row_bytes(in_features):
        raise ValueError(f"{fmt.name} rows of {in_features} weights hold {fmt.row_bytes(in_features)} bytes, "
                         f"not {data.shape[-1]}")
    blocks = data.reshape(rows * (in_features // fmt.block_weights), fmt.block_bytes)
    q, d, m = _DECODERS[fmt](blocks)
    groups = q.float().reshape(blocks.shape[0], d.shape[1], -1)  # the weights each d and m scale
    return (d.unsqueeze(-1) * groups + m.unsqueeze(-1)).reshape(rows, in_features)
