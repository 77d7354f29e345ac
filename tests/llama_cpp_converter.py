"""llama.cpp's own convert_hf_to_gguf.py, as the tests of the model families run it: a GGUF file that our
reader loads must be one llama.cpp's converter wrote, never one our code wrote (that would only show our
reader agrees with our writer).

scripts/setup.sh test takes the converter (with its `conversion` package and its own gguf-py) from the
llama-cpp-python source distribution on PyPI into the virtual environment's llama-cpp-convert/.
Several directories convert in one process, so torch and transformers are imported once, and a file
converted before from the same bytes by the same converter is taken from this machine's cache (the
conversions cost 10-20 s of every suite run)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
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


def _digest(root: Path, h: hashlib._Hash) -> None:
    for path in sorted(p for p in root.rglob("*") if p.is_file() and "__pycache__" not in p.parts):
        h.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes())


def _kept(directory: Path) -> Path:
    """Where this machine keeps the converter's output for directory: keyed by the directory's bytes and
    the converter's (its script, its conversion package and gguf-py)."""
    h = hashlib.sha256()
    _digest(directory, h)
    _digest(CONVERTER, h)
    return Path(tempfile.gettempdir()) / f"tandem-tests-{os.getuid()}" / f"llama-cpp-{h.hexdigest()[:24]}.gguf"


def convert(directories: list[Path]) -> list[Path]:
    """Each Hugging Face directory as a float32 GGUF file beside it (<dir>.gguf)."""
    if not converter_available():
        raise RuntimeError(f"llama.cpp's converter is not at {CONVERTER}: run scripts/setup.sh test")
    outs = [d.with_suffix(".gguf") for d in directories]
    kept = [_kept(d) for d in directories]
    todo = [(d, o, k) for d, o, k in zip(directories, outs, kept, strict=True) if not k.exists()]
    if todo:
        args = [str(p) for d, o, _ in todo for p in (d, o)]
        run = subprocess.run([sys.executable, "-c", _DRIVER, str(CONVERTER), *args], capture_output=True,
                             text=True, timeout=600)
        if run.returncode:
            raise RuntimeError(f"convert_hf_to_gguf.py failed:\n{run.stderr[-4000:]}")
        for _, out, k in todo:  # staged, then renamed: a concurrent session never reads half a file
            k.parent.mkdir(parents=True, exist_ok=True)
            staged = k.with_name(f"{k.name}.{os.getpid()}.part")
            shutil.copyfile(out, staged)
            staged.rename(k)
    for out, k in zip(outs, kept, strict=True):
        if not out.exists():
            shutil.copyfile(k, out)
    return outs


def declare_gpt2_tokenizer(directory: Path) -> None:
    """Phi-3's converter reads a BPE vocabulary only from a tokenizer_config.json that names
    GPT2Tokenizer (it expects SentencePiece otherwise); transformers 5 saves another class name."""
    config = directory / "tokenizer_config.json"
    data = json.loads(config.read_text())
    config.write_text(json.dumps({**data, "tokenizer_class": "GPT2Tokenizer"}))
