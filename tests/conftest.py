"""Shared fixtures. Every engine a test builds is checked afterwards: every KV block is free."""

from __future__ import annotations

import copy
import functools
import hashlib
import importlib.metadata
import json
import os
import shutil
import tempfile
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

from parallel_streams import machine_share, own_core

own_core()  # before torch loads (a parallel stream's OpenMP pool then has its one core's thread)

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import safetensors.torch  # noqa: E402
import torch  # noqa: E402

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
DATA = Path(__file__).parent / "data"


def assert_pool_clean(engine) -> None:  # noqa: ANN001 (LLMEngine; imported lazily)
    scheduler = engine.core.scheduler
    pool = scheduler.kv.pool
    assert not scheduler.requests, f"requests left in the scheduler: {list(scheduler.requests)}"
    assert not scheduler.kv.req_blocks, "block tables left behind"
    # Every block is free, or held by a retained conversation (a stored response's), once per handle.
    retained = Counter(b.block_id for blocks in scheduler.kv.retained.values() for b in blocks)
    in_use = pool.num_blocks - pool.num_free_blocks
    assert in_use == len(retained), f"{in_use - len(retained)} blocks leaked"
    assert all(b.ref_cnt == retained.get(b.block_id, 0) for b in pool.blocks)
    assert not engine.outputs.has_unfinished()


_engines: list = []


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[object]:
    with machine_share(item.get_closest_marker("whole_machine") is not None):
        return (yield)


@pytest.fixture(autouse=True)
def _check_engines_after_test() -> Iterator[None]:
    yield
    for engine in _engines:
        assert_pool_clean(engine)


@pytest.fixture(scope="session")
def default_model_path() -> Path:
    from tandem.model_path import default_model_path

    return default_model_path()


MAX_CACHED_ENGINES = 6  # each holds its weights and the pool it touched: ~30 distinct ones outgrew 24 GiB


@pytest.fixture(scope="session")
def make_llm() -> Callable[..., object]:
    """Build an LLM whose pool is checked after every test. Engines are cached by options, the most
    recently used few: an evicted one is checked clean and dropped (a module fixture that still holds
    it keeps it alive until the module ends)."""
    import gc

    from tandem import LLM

    cache: dict[tuple, LLM] = {}

    def make(**options: object) -> LLM:
        if "num_blocks" not in options:
            options.setdefault("kv_cache_memory", 0.5)
        # Not the shipped default (commit the whole pool at start-up, tests/test_host_memory.py checks it):
        # a test touches a few MB of its pool, and committing 0.5 GiB cost each engine 0.3-0.9 s here
        # (this VM's host backs freed guest pages again on first touch). Outputs do not depend on it.
        options.setdefault("prefault_kv_cache", False)
        key = tuple(sorted(options.items()))
        if key in cache:
            cache[key] = cache.pop(key)  # most recently used last
            return cache[key]
        if len(cache) >= MAX_CACHED_ENGINES:
            oldest = cache.pop(next(iter(cache)))
            assert_pool_clean(oldest.engine)
            _engines.remove(oldest.engine)
            del oldest
            gc.collect()
        cache[key] = LLM(**options)
        _engines.append(cache[key].engine)
        return cache[key]

    return make


# The server most tests talk to: the shipped defaults (admission queue, bfloat16 where native,
# batch-invariant kernels, the native layer stack), with a small pool so several servers fit.
DEFAULT_SERVER = ("--kv-cache-memory", "0.5")
# For tests that compare tokens or logprobs with transformers in float32 (each says so).
FP32_SERVER = ("--dtype", "float32", "--kv-cache-memory", "0.25")
# Suffix speculation with a fixed draft length (no adaptive policy: the tests need drafts to be made).
SUFFIX = {"method": "suffix", "num_speculative_tokens": 6, "adaptive": False}
# The session's 1P1D deployment of the default model (float32: its tests compare tokens with the in-process
# engine's): every prompt through the pair, a small token budget (chunked prefill: layer-wise transfers over
# several steps) and speculating workers. A grammar-constrained request gets no drafts, so the structured
# outputs' test shares it with the speculative one.
FP32_1P1D = (*FP32_SERVER, "--max-num-batched-tokens", "64", "--speculative-config", json.dumps(SUFFIX),
             "--prefill-workers", "1", "--decode-workers", "1",
             "--path-policy", "disaggregated")


@pytest.fixture(scope="session")
def shared_server() -> Iterator[Callable[..., object]]:
    """A real `tandem serve` per argument list, started on first use and kept for the session (each
    start costs seconds of model loading and profiling). Tests that kill, restart or count on a
    fresh server start their own."""
    from server_utils import Server

    servers: dict[tuple[str, ...], Server] = {}

    def get(*args: str) -> Server:
        if args not in servers or servers[args].proc.poll() is not None:
            server = Server(list(args))
            servers[args] = server
            server.wait_ready()
        return servers[args]

    yield get
    for server in servers.values():
        server.stop()


@pytest.fixture(scope="session")
def llm_fp32(make_llm):  # noqa: ANN001, ANN201
    return make_llm(dtype="float32")


@pytest.fixture(scope="session")
def passages() -> list[str]:
    return [p for p in (DATA / "passages.txt").read_text().splitlines() if p.strip()]


@functools.cache
def _file_digest(path: Path, size: int, mtime_ns: int) -> str:  # size and mtime: a changed file hashes again
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _kept_conversion(path: Path, what: str) -> Path:
    """Where transformers' conversion of a GGUF file is kept on this machine: keyed by the file's bytes (not
    its path: the default model's file lives in the virtual environment, so a fresh checkout's path is new
    and its conversion, 10-45 s, was done again on every CI run) and the libraries' versions."""
    import transformers

    stat = path.stat()
    versions = [transformers.__version__, importlib.metadata.version("gguf"), torch.__version__]
    ident = f"{path.name}:{_file_digest(path.resolve(), stat.st_size, stat.st_mtime_ns)}:{versions}"
    return Path(tempfile.gettempdir()) / f"tandem-tests-{os.getuid()}" / \
        f"hf-{what}-{path.stem}-{hashlib.sha256(ident.encode()).hexdigest()[:16]}"


def _keep(kept: Path, write: Callable[[Path], None]) -> None:
    """Write a directory atomically (staged, then renamed): parallel or repeated sessions share it."""
    kept.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=kept.parent))
    try:
        write(staging)
        staging.rename(kept)
    except OSError:  # another session kept it first, or the disk is full: not kept
        shutil.rmtree(staging, ignore_errors=True)


def load_hf_gguf_tokenizer(path: Path):  # noqa: ANN201
    """transformers' tokenizer of a GGUF file (its own conversion of the file's tokenizer keys), kept
    per machine as load_hf_gguf keeps the model."""
    from transformers import AutoTokenizer

    kept = _kept_conversion(path, "tokenizer")
    if (kept / "tokenizer_config.json").exists():
        return AutoTokenizer.from_pretrained(kept)
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    _keep(kept, tokenizer.save_pretrained)
    return tokenizer


def load_hf_gguf(path: Path):  # noqa: ANN201
    """Hugging Face transformers on a GGUF file's weights (its own dequantizer), float32, in eval mode.

    transformers' own conversion of the file is kept per machine (safetensors in the temp directory,
    keyed by the file and the library's versions, written atomically): reading it back takes a second
    where converting again takes 10-45 s, nearly all of it gguf-py parsing the tokenizer's arrays."""
    import gguf
    from transformers import AutoModelForCausalLM

    kept = _kept_conversion(path, "model")
    if (kept / "config.json").exists():
        return AutoModelForCausalLM.from_pretrained(kept, dtype=torch.float32).eval()
    # Speed only (its numbers are untouched): transformers reads the file twice (config, then weights)
    # and rebuilds gguf-py's tensor-name map per tensor; both are pure functions of their arguments.
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf, "GGUFReader", functools.lru_cache(maxsize=None)(gguf.GGUFReader))
        mp.setattr(gguf, "get_tensor_name_map", functools.lru_cache(maxsize=None)(gguf.get_tensor_name_map))
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    # The converted model, as a plain checkpoint: transformers will not save a model it loaded from
    # GGUF (it counts as quantized), so its config less the GGUF marker, and its tensors.
    config = copy.deepcopy(model.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config

    def write(directory: Path) -> None:
        config.save_pretrained(directory)
        model.generation_config.save_pretrained(directory)
        safetensors.torch.save_model(model, str(directory / "model.safetensors"))

    _keep(kept, write)
    return model.eval()


@pytest.fixture(scope="session")
def hf_reference(default_model_path: Path):  # noqa: ANN201
    """Hugging Face transformers on the same GGUF weights (its own dequantizer), float32."""
    return load_hf_gguf(default_model_path)


def random_hf_model(cls, cfg, path: Path, adjust=None):  # noqa: ANN001, ANN201
    """A transformers model of cls built from cfg with random weights everywhere (norm weights in
    [0.5, 1.5], biases included, so every weight is exercised), seeded, saved to path as safetensors;
    adjust(name, parameter) may change a parameter in place first. Returns (path, model)."""
    torch.manual_seed(0)
    model = cls(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.empty_like(p).uniform_(0.5, 1.5) if "norm" in name else torch.randn_like(p) * 0.08)
            if adjust is not None:
                adjust(name, p)
    model.save_pretrained(path, safe_serialization=True)
    return path, model


def hf_forward_greedy(ref, prompt: list[int], n: int) -> list[int]:  # noqa: ANN001
    """transformers' forward pass, argmax, one token at a time over the whole sequence: the reference for
    a mixture of experts, where transformers' generate() can differ from its own forward (71 against
    the forward's 86 on one Qwen3-MoE prompt, transformers 5.24's grouped_mm experts)."""
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(n):
            ids.append(int(ref(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def check_greedy_with_a_prefix_hit(llm, ref, vocab: int, lengths: tuple[int, ...],  # noqa: ANN001
                                   max_tokens: int = 10) -> None:
    """Random prompts of these lengths, then two sharing a 24-token head that the second finds cached:
    greedy tokens equal transformers' forward (hf_forward_greedy), and the pool is clean after."""
    from tandem import SamplingParams

    gen = np.random.default_rng(1)
    head = gen.integers(0, vocab, 24).tolist()
    prompts = [gen.integers(0, vocab, n).tolist() for n in lengths] + [head + [5, 6], head + [7]]
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate(prompts[:-1], params) + llm.generate(prompts[-1:], params)
    for p, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == hf_forward_greedy(ref, p, max_tokens)
    assert outs[-1].num_cached_tokens >= 20
    assert_pool_clean(llm.engine)


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:  # noqa: ANN001
    with torch.inference_mode():
        ids = torch.tensor([prompt_ids])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()
