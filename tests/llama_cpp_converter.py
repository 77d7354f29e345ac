"""llama.cpp's own convert_hf_to_gguf.py, as the tests of the model families run it: a GGUF file that our
reader loads must be one llama.cpp's converter wrote, never one our code wrote (that would only show our
reader agrees with our writer).

scripts/setup.sh test takes the converter (with its `conversion` package and its own gguf-py) from the
llama-cpp-python source distribution on PyPI into the virtual environment's llama-cpp-convert/.
Several directories convert in one process, so torch and transformers are imported once."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

CONVERTER = Path(sys.prefix) / "llama-cpp-convert"

_DRIVER = """
import sys
sys.path.insert(0, sys.argv[1])
import convert_hf_to_gguf
for src, out in zip(sys.argv[2::2], sys.argv[3::2]):
    sys.argv = ["convert_hf_to_gguf.py", src, "--outtype", "f32", "--outfile", out]
    convert_hf_to_gguf.main()
"""


def converter_available() -> bool:
    return (CONVERTER / "convert_hf_to_gguf.py").exists()


def convert(directories: list[Path]) -> list[Path]:
    """Each Hugging Face directory as a float32 GGUF file beside it (<dir>.gguf)."""
    if not converter_available():
        raise RuntimeError(f"llama.cpp's converter is not at {CONVERTER}: run scripts/setup.sh test")
    outs = [d.with_suffix(".gguf") for d in directories]
    args = [str(p) for d, o in zip(directories, outs, strict=True) for p in (d, o)]
    run = subprocess.run([sys.executable, "-c", _DRIVER, str(CONVERTER), *args], capture_output=True, text=True,
                         timeout=600)
    if run.returncode:
        raise RuntimeError(f"convert_hf_to_gguf.py failed:\n{run.stderr[-4000:]}")
    return outs


def declare_gpt2_tokenizer(directory: Path) -> None:
    """Phi-3's converter reads a BPE vocabulary only from a tokenizer_config.json that names
    GPT2Tokenizer (it expects SentencePiece otherwise); transformers 5 saves another class name."""
    config = directory / "tokenizer_config.json"
    data = json.loads(config.read_text())
    config.write_text(json.dumps({**data, "tokenizer_class": "GPT2Tokenizer"}))
