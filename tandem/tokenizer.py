"""A model's tokenizer without its weights: from a GGUF file's metadata (converted once, then cached) or a
Hugging Face directory's tokenizer files. The model loader, the API process and the benchmark client share it."""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
from pathlib import Path
from typing import Any

from tandem.cache import cache_dir
from tandem.model_path import resolve_model_path

log = logging.getLogger(__name__)


def _from_directory(path: Path) -> Any:
    """AutoTokenizer's tokenizer of a directory, straight from the generic fast class where the config
    names it (a GGUF's converted tokenizer does): AutoTokenizer's resolution imports every model
    family's module list first, about 1.3 s of each process's start."""
    try:
        cls = json.loads((path / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError):
        cls = None
    if cls == "TokenizersBackend":
        from transformers.tokenization_utils_tokenizers import TokenizersBackend

        return TokenizersBackend.from_pretrained(path)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def _gguf_cache(path: Path) -> Path:
    """Where a GGUF file's converted tokenizer is kept: keyed by the metadata it is built from, so files
    with the same tokenizer (quantizations and copies of one model) convert it once."""
    from tandem.gguf_index import tokenizer_digest

    return cache_dir() / "tokenizers" / tokenizer_digest(path)


def load_gguf_tokenizer(path: Path) -> Any | None:
    """Build a fast tokenizer from the GGUF metadata once, then load it from the cache; None for a
    file without tokenizer metadata (served on token ids, as a directory without tokenizer files)."""
    cached = _gguf_cache(path)
    if (cached / "tokenizer.json").exists():
        return _from_directory(cached)
    from transformers import AutoTokenizer, PreTrainedTokenizerFast
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    from tandem.gguf_index import read_gguf

    _, meta = read_gguf(path)  # the cached index: no second parse of the file's header
    if "tokenizer.ggml.tokens" not in meta:
        return None
    log.info("building tokenizer from GGUF metadata (cached afterwards in %s)", cached)
    if meta.get("general.architecture") in GGUF_SUPPORTED_ARCHITECTURES:
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    else:
        # AutoTokenizer reads the model's config first and knows fewer architectures than Tandem
        # serves (smollm3, granite ...); the fast tokenizer is built from the tokenizer.* keys alone.
        tokenizer = PreTrainedTokenizerFast.from_pretrained(path.parent, gguf_file=path.name)
    # Written whole or not at all: another process may be converting the same tokenizer.
    cached.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=cached.parent))
    tokenizer.save_pretrained(staging)
    try:
        staging.rename(cached)
    except OSError:  # the other process finished first
        shutil.rmtree(staging, ignore_errors=True)
    return tokenizer


def load_hf_tokenizer(path: Path) -> Any | None:
    if not any((path / f).exists() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return None
    return _from_directory(path)


def load_tokenizer(model: str | None) -> Any | None:
    """The tokenizer alone (for a process that serves HTTP but holds no weights)."""
    path = resolve_model_path(model)
    return load_hf_tokenizer(path) if path.is_dir() else load_gguf_tokenizer(path)


_UNREAD = object()


def _named_eos(directory: Path) -> Any:
    """The eos token's id as tokenizer_config.json names it and tokenizer.json numbers it, read with
    the tokenizers library alone; _UNREAD where the files do not say it that way."""
    try:
        eos = json.loads((directory / "tokenizer_config.json").read_text()).get("eos_token", _UNREAD)
    except (OSError, ValueError):
        return _UNREAD
    if isinstance(eos, dict):
        eos = eos.get("content", _UNREAD)
    if eos is None:
        return None
    if not isinstance(eos, str) or not (directory / "tokenizer.json").exists():
        return _UNREAD
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(directory / "tokenizer.json")).token_to_id(eos)


def eos_token_id(model: str | None) -> int | None:
    """The tokenizer's end-of-sequence id, as the tokenizer loaded whole would give it. An engine
    process needs only this of the tokenizer at start (its grammars load the rest on first use), and
    importing transformers and building the tokenizer cost each engine process about 1.5 s of CPU."""
    path = resolve_model_path(model)
    directory = path if path.is_dir() else _gguf_cache(path)
    eos = _named_eos(directory)
    if eos is _UNREAD:  # not converted yet, or named another way: the whole tokenizer says it
        eos = getattr(load_tokenizer(str(path)), "eos_token_id", None)
    return eos
