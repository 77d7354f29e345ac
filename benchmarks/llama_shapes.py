"""Random-weight Llama 3.2 models at their real shapes, as GGUF files made by llama.cpp's own tools:
for speed at the sizes users serve (issue #46). Random weights say nothing about quality.

    .venv/bin/pip install -e ".[bench]"      # sentencepiece, which the converter imports
    .venv/bin/python benchmarks/llama_shapes.py --llama-cpp /work/llama/llama.cpp 1b Q4_K_M Q4_0

Shapes (Llama-3.2-1B and 3B; the vocabulary is Llama 3's 128,256: SmolLM2's tokenizer, which llama.cpp's
converter pads to the config's size):
  1b  hidden 2048, 16 layers, 32 heads, 8 KV heads, MLP 8192, tied embeddings
  3b  hidden 3072, 28 layers, 24 heads, 8 KV heads, MLP 8192, tied embeddings
Made once into ~/.cache/tandem/models/llama-3.2-<size>-shape-<type>.gguf: a Hugging Face directory of
seeded normal weights (std 0.02, bfloat16), `convert_hf_to_gguf.py --outtype bf16`, then
`llama-quantize` (llama.cpp's source ships in the llama-cpp-python sdist on PyPI; benchmarks/vs_llama_cpp.py
says how to build it). Prints the paths.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from pathlib import Path

import torch

from tandem.cache import cache_dir
from tandem.model_path import default_model_path
from tandem.tokenizer import load_gguf_tokenizer

SHAPES = {
    "1b": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
               intermediate_size=8192),
    "3b": dict(hidden_size=3072, num_hidden_layers=28, num_attention_heads=24, num_key_value_heads=8,
               intermediate_size=8192),
}
VOCAB = 128256


def hf_directory(size: str, out: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    if (out / "config.json").exists():
        return out
    tokenizer = load_gguf_tokenizer(default_model_path())
    cfg = LlamaConfig(vocab_size=VOCAB, max_position_embeddings=131072, rope_theta=500000.0, tie_word_embeddings=True,
                      rms_norm_eps=1e-5, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                      torch_dtype="bfloat16", **SHAPES[size])
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # built in bfloat16, not built in float32 and copied
    try:
        model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(default)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.02)
    staging = out.with_suffix(".partial")
    shutil.rmtree(staging, ignore_errors=True)
    model.save_pretrained(staging, safe_serialization=True)
    tokenizer.save_pretrained(staging)
    staging.rename(out)
    return out


def gguf_file(size: str, qtype: str, llama_cpp: Path) -> Path:
    models = cache_dir() / "models"
    models.mkdir(parents=True, exist_ok=True)
    out = models / f"llama-3.2-{size}-shape-{qtype}.gguf"
    if out.exists():
        return out
    bf16 = models / f"llama-3.2-{size}-shape-BF16.gguf"
    if not bf16.exists():
        hf = hf_directory(size, models / f"llama-3.2-{size}-shape-hf")
        subprocess.run([sys.executable, str(llama_cpp / "convert_hf_to_gguf.py"), str(hf), "--outtype", "bf16",
                        "--outfile", str(bf16)], check=True)
    if qtype == "BF16":
        return bf16
    quantize = next(p for p in (llama_cpp / "build" / "bin" / "llama-quantize",) if p.exists())
    subprocess.run([str(quantize), str(bf16), str(out.with_suffix(".partial")), qtype], check=True)
    out.with_suffix(".partial").rename(out)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-cpp", type=Path, required=True, help="llama.cpp's source tree, llama-quantize built")
    ap.add_argument("size", choices=sorted(SHAPES))
    ap.add_argument("types", nargs="+", help="llama-quantize types, e.g. Q4_K_M Q4_0 (BF16: the converted file)")
    args = ap.parse_args()
    for qtype in args.types:
        print(gguf_file(args.size, qtype, args.llama_cpp))


if __name__ == "__main__":
    main()
