"""Random-weight models at the real shapes of the checkpoints users serve, as GGUF files made by
llama.cpp's own tools: for speed at size (issues #46, #47). Random weights say nothing about quality.

    .venv/bin/pip install -e ".[bench]"      # sentencepiece, which the converter imports
    .venv/bin/python benchmarks/model_shapes.py --llama-cpp /work/llama/llama.cpp 1b Q4_K_M Q4_0

Shapes (the real vocabulary sizes: SmolLM2's tokenizer, which llama.cpp's converter pads to the config's size):
  1b           Llama-3.2-1B: hidden 2048, 16 layers, 32 heads, 8 KV heads, MLP 8192, tied, vocab 128,256
  3b           Llama-3.2-3B: hidden 3072, 28 layers, 24 heads, 8 KV heads, MLP 8192, tied, vocab 128,256
  8b           Llama-3.1-8B: hidden 4096, 32 layers, 32 heads, 8 KV heads, MLP 14336, untied, vocab 128,256
               (written layer by layer, converted to Q8_0 rather than bf16, then requantized: a bf16 copy
               would need 16 GB more disk; the types llama-quantize picks per tensor are the same)
  phi-4-mini   Phi-4-mini: hidden 3072, 32 layers, 24 heads, 8 KV heads, MLP 8192, tied, vocab 200,064,
               96 of 128 dimensions rotated, longrope (original context 4,096 of 131,072)
  smollm3-3b   SmolLM3-3B: hidden 2048, 36 layers, 16 heads, 4 KV heads, MLP 11008, tied, vocab 128,256,
               every fourth layer without RoPE
  gpt-oss-20b  gpt-oss-20b: hidden 2880, 24 layers, 64 heads of 64, 8 KV heads, 32 experts (top 4) of 2880,
               sinks, sliding window 128 every other layer, vocab 201,088; its experts in MXFP4 as it ships
               (type MXFP4: the converter's file, the rest in Q8_0; llama-quantize is not run)
  qwen2.5-1.5b Qwen2.5-1.5B: hidden 1536, 28 layers, 12 heads, 2 KV heads, MLP 8960, q/k/v biases, tied,
               vocab 151,936 (its config.json names model_type llama for the converter's tokenizer load only:
               transformers would give a Qwen2 directory Qwen2's pre-tokenizer, which the converter does not
               recognise over SmolLM2's vocabulary; the file is a qwen2 one)
Made once into ~/.cache/tandem/models/<name>-shape-<type>.gguf: a Hugging Face directory of seeded normal
weights (std 0.02, bfloat16), `convert_hf_to_gguf.py --outtype bf16`, then `llama-quantize` (llama.cpp's
source ships in the llama-cpp-python sdist on PyPI; benchmarks/vs_llama_cpp.py says how to build it).
Prints the paths.
"""

from __future__ import annotations

import argparse
import functools
import shutil
import subprocess
import sys
from pathlib import Path

import torch

from tandem.cache import cache_dir
from tandem.model_path import default_model_path
from tandem.tokenizer import load_gguf_tokenizer

LLAMA3 = dict(architecture="LlamaForCausalLM", vocab_size=128256, rope_theta=500000.0, rms_norm_eps=1e-5,
              max_position_embeddings=131072, tie_word_embeddings=True, num_key_value_heads=8, intermediate_size=8192)
SHAPES = {
    "1b": dict(LLAMA3, hidden_size=2048, num_hidden_layers=16, num_attention_heads=32),
    "3b": dict(LLAMA3, hidden_size=3072, num_hidden_layers=28, num_attention_heads=24),
    "8b": dict(LLAMA3, hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, intermediate_size=14336,
               tie_word_embeddings=False),
    "phi-4-mini": dict(architecture="Phi3ForCausalLM", vocab_size=200064, hidden_size=3072, num_hidden_layers=32,
                       num_attention_heads=24, num_key_value_heads=8, intermediate_size=8192, rms_norm_eps=1e-5,
                       max_position_embeddings=131072, original_max_position_embeddings=4096,
                       tie_word_embeddings=True, partial_rotary_factor=0.75,
                       rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                        "partial_rotary_factor": 0.75, "original_max_position_embeddings": 4096,
                                        "long_factor": [1.0 + i for i in range(48)], "short_factor": [1.0] * 48}),
    "qwen2.5-1.5b": dict(architecture="Qwen2ForCausalLM", vocab_size=151936, hidden_size=1536, num_hidden_layers=28,
                         num_attention_heads=12, num_key_value_heads=2, intermediate_size=8960, rms_norm_eps=1e-6,
                         rope_theta=1000000.0, max_position_embeddings=32768, tie_word_embeddings=True),
    "smollm3-3b": dict(architecture="SmolLM3ForCausalLM", vocab_size=128256, hidden_size=2048, num_hidden_layers=36,
                       num_attention_heads=16, num_key_value_heads=4, intermediate_size=11008, rms_norm_eps=1e-6,
                       rope_theta=5000000.0, max_position_embeddings=65536, tie_word_embeddings=True),
}
GPT_OSS_20B = dict(architecture="GptOssForCausalLM", vocab_size=201088, hidden_size=2880, intermediate_size=2880,
                   num_hidden_layers=24, num_attention_heads=64, num_key_value_heads=8, head_dim=64,
                   num_local_experts=32, num_experts_per_tok=4, sliding_window=128, max_position_embeddings=131072,
                   rms_norm_eps=1e-5, tie_word_embeddings=False)
LAYER_BY_LAYER = ("8b",)  # written tensor by tensor, converted to Q8_0 (see the docstring)
NAMES = {"1b": "llama-3.2-1b", "3b": "llama-3.2-3b", "8b": "llama-3.1-8b", "phi-4-mini": "phi-4-mini",
         "smollm3-3b": "smollm3-3b",
         "qwen2.5-1.5b": "qwen2.5-1.5b", "gpt-oss-20b": "gpt-oss-20b"}


def gpt_oss_directory(out: Path) -> Path:
    """gpt-oss-20b's checkpoint as it ships (experts as MXFP4 blocks and scales, the rest bfloat16), written
    tensor by tensor: 21B parameters never exist as one model in memory. Blocks are random bytes with
    exponents 2^-8 to 2^-5 (weights of about the float ones' size); the rest seeded normal (std 0.02)."""
    import json

    from safetensors.torch import save_file
    from transformers import GptOssConfig

    if (out / "config.json").exists():
        return out
    tokenizer = load_gguf_tokenizer(default_model_path())
    spec = {k: v for k, v in GPT_OSS_20B.items() if k != "architecture"}
    cfg = GptOssConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, **spec)
    staging = out.with_suffix(".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    gen = torch.Generator().manual_seed(0)
    h, e, inter, d = cfg.hidden_size, cfg.num_local_experts, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d

    def normal(*shape: int) -> torch.Tensor:
        return (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16)

    def mxfp4(rows: int, cols: int) -> dict[str, torch.Tensor]:
        return {"blocks": torch.randint(0, 256, (e, rows, cols // 32, 16), dtype=torch.uint8, generator=gen),
                "scales": torch.randint(119, 123, (e, rows, cols // 32), dtype=torch.uint8, generator=gen)}

    index: dict[str, str] = {}
    count = cfg.num_hidden_layers + 1

    def write(n: int, shard: dict[str, torch.Tensor]) -> None:  # one shard at a time: at most a layer in memory
        file = f"model-{n:05d}-of-{count:05d}.safetensors"
        save_file(shard, staging / file, metadata={"format": "pt"})
        index.update({name: file for name in shard})

    write(0, {"model.embed_tokens.weight": normal(cfg.vocab_size, h), "lm_head.weight": normal(cfg.vocab_size, h),
              "model.norm.weight": torch.ones(h, dtype=torch.bfloat16)})
    for i in range(cfg.num_hidden_layers):
        pre = f"model.layers.{i}."
        layer = {f"{pre}input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
                 f"{pre}post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
                 f"{pre}self_attn.sinks": normal(cfg.num_attention_heads), f"{pre}mlp.router.weight": normal(e, h),
                 f"{pre}mlp.router.bias": normal(e), f"{pre}mlp.experts.gate_up_proj_bias": normal(e, 2 * inter),
                 f"{pre}mlp.experts.down_proj_bias": normal(e, h)}
        for name, rows in (("q", q), ("k", kv), ("v", kv)):
            layer[f"{pre}self_attn.{name}_proj.weight"] = normal(rows, h)
            layer[f"{pre}self_attn.{name}_proj.bias"] = normal(rows)
        layer[f"{pre}self_attn.o_proj.weight"], layer[f"{pre}self_attn.o_proj.bias"] = normal(h, q), normal(h)
        for name, (rows, cols) in (("gate_up_proj", (2 * inter, h)), ("down_proj", (h, inter))):
            for part, t in mxfp4(rows, cols).items():
                layer[f"{pre}mlp.experts.{name}_{part}"] = t
        write(i + 1, layer)
    (staging / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))
    config = cfg.to_dict() | {"architectures": ["GptOssForCausalLM"], "quantization_config": {
        "quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                                            "model.embed_tokens", "lm_head"]}}
    (staging / "config.json").write_text(json.dumps(config))
    tokenizer.save_pretrained(staging)
    staging.rename(out)
    return out


def llama_directory(shape: str, out: Path) -> Path:
    """A Llama checkpoint (seeded normal weights, std 0.02, bfloat16) written layer by layer, as
    gpt_oss_directory is: an 8B model never exists whole in this process's memory."""
    import json

    from safetensors.torch import save_file
    from transformers import LlamaConfig

    if (out / "config.json").exists():
        return out
    tokenizer = load_gguf_tokenizer(default_model_path())
    spec = {k: v for k, v in SHAPES[shape].items() if k != "architecture"}
    cfg = LlamaConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                      pad_token_id=tokenizer.eos_token_id, torch_dtype="bfloat16", **spec)
    staging = out.with_suffix(".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    gen = torch.Generator().manual_seed(0)
    h, inter = cfg.hidden_size, cfg.intermediate_size
    d = h // cfg.num_attention_heads
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d

    def normal(*dims: int) -> torch.Tensor:
        return (torch.randn(dims, generator=gen) * 0.02).to(torch.bfloat16)

    ones = functools.partial(torch.ones, h, dtype=torch.bfloat16)
    index: dict[str, str] = {}
    count = cfg.num_hidden_layers + 1

    def write(n: int, shard: dict[str, torch.Tensor]) -> None:
        file = f"model-{n:05d}-of-{count:05d}.safetensors"
        save_file(shard, staging / file, metadata={"format": "pt"})
        index.update({name: file for name in shard})

    head = {"model.embed_tokens.weight": normal(cfg.vocab_size, h), "model.norm.weight": ones()}
    if not cfg.tie_word_embeddings:
        head["lm_head.weight"] = normal(cfg.vocab_size, h)
    write(0, head)
    for i in range(cfg.num_hidden_layers):
        pre = f"model.layers.{i}."
        write(i + 1, {f"{pre}input_layernorm.weight": ones(), f"{pre}post_attention_layernorm.weight": ones(),
                      f"{pre}self_attn.q_proj.weight": normal(q, h), f"{pre}self_attn.k_proj.weight": normal(kv, h),
                      f"{pre}self_attn.v_proj.weight": normal(kv, h), f"{pre}self_attn.o_proj.weight": normal(h, q),
                      f"{pre}mlp.gate_proj.weight": normal(inter, h), f"{pre}mlp.up_proj.weight": normal(inter, h),
                      f"{pre}mlp.down_proj.weight": normal(h, inter)})
    (staging / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))
    (staging / "config.json").write_text(json.dumps(cfg.to_dict() | {"architectures": ["LlamaForCausalLM"]}))
    tokenizer.save_pretrained(staging)
    staging.rename(out)
    return out


def hf_directory(shape: str, out: Path) -> Path:
    import json

    import transformers

    if (out / "config.json").exists():
        return out
    if shape in LAYER_BY_LAYER:
        return llama_directory(shape, out)
    tokenizer = load_gguf_tokenizer(default_model_path())
    spec = dict(SHAPES[shape])
    arch = spec.pop("architecture")
    model_cls = getattr(transformers, arch)
    cfg = model_cls.config_class(bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                                 pad_token_id=tokenizer.eos_token_id, torch_dtype="bfloat16", **spec)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # built in bfloat16, not built in float32 and copied
    try:
        model = model_cls(cfg)
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
    if arch == "Phi3ForCausalLM":  # Phi-3's converter reads a BPE vocabulary only from a GPT2Tokenizer config
        config = staging / "tokenizer_config.json"
        config.write_text(json.dumps({**json.loads(config.read_text()), "tokenizer_class": "GPT2Tokenizer"}))
    if arch == "Qwen2ForCausalLM":  # the converter loads the tokenizer by model_type (see the docstring)
        config = staging / "config.json"
        config.write_text(json.dumps({**json.loads(config.read_text()), "model_type": "llama"}))
    staging.rename(out)
    return out


def gguf_file(shape: str, qtype: str, llama_cpp: Path) -> Path:
    models = cache_dir() / "models"
    models.mkdir(parents=True, exist_ok=True)
    out = models / f"{NAMES[shape]}-shape-{qtype}.gguf"
    if out.exists():
        return out
    if shape == "gpt-oss-20b":  # the converter keeps the MXFP4 experts; the rest it writes as Q8_0
        if qtype != "MXFP4":
            raise SystemExit("gpt-oss-20b is made as it ships: type MXFP4")
        hf = gpt_oss_directory(models / f"{NAMES[shape]}-shape-hf")
        subprocess.run([sys.executable, str(llama_cpp / "convert_hf_to_gguf.py"), str(hf), "--outtype", "q8_0",
                        "--outfile", str(out.with_suffix(".partial"))], check=True)
        out.with_suffix(".partial").rename(out)
        return out
    # The converter's file: bf16, or Q8_0 for the shapes too large for a bf16 copy on a small disk.
    source_type = "Q8_0" if shape in LAYER_BY_LAYER else "BF16"
    source = models / f"{NAMES[shape]}-shape-{source_type}.gguf"
    if not source.exists():
        hf = hf_directory(shape, models / f"{NAMES[shape]}-shape-hf")
        subprocess.run([sys.executable, str(llama_cpp / "convert_hf_to_gguf.py"), str(hf), "--outtype",
                        source_type.lower(), "--outfile", str(source)], check=True)
    if qtype == source_type:
        return source
    quantize = next(p for p in (llama_cpp / "build" / "bin" / "llama-quantize",) if p.exists())
    subprocess.run([str(quantize), *(["--allow-requantize"] if source_type != "BF16" else []), str(source),
                    str(out.with_suffix(".partial")), qtype], check=True)
    out.with_suffix(".partial").rename(out)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-cpp", type=Path, required=True, help="llama.cpp's source tree, llama-quantize built")
    ap.add_argument("shape", choices=sorted(NAMES))
    ap.add_argument("types", nargs="+", help="llama-quantize types, e.g. Q4_K_M Q4_0 (BF16: the converted file)")
    args = ap.parse_args()
    for qtype in args.types:
        print(gguf_file(args.shape, qtype, args.llama_cpp))


if __name__ == "__main__":
    main()
