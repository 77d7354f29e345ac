"""Benchmark workloads, generated locally from a seed (nothing is downloaded).

Every generator returns a list of `Session`s. A session is one request, or for multi-turn
conversations several requests sent one after another, each carrying the history before it.
Prompts are drawn as token counts and turned into text whose token count is known, because a
benchmark has to send text for any server to accept it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from tandem.bench.copy_tasks import COPY_TASKS, copy_prompt

DATASETS = ("random", "synthetic_chat", "prefix_repetition", "multi_turn", "long_short", "mooncake_trace", "copy")

# Words come from the lowest token ids that pass the checks: those are the tokenizer's earliest
# merges, i.e. common words, so prompts look like (nonsense) text rather than noise.
WORD_POOL_SIZE = 4096


class Tokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, token_ids: list[int]) -> str: ...

    def __len__(self) -> int: ...


@dataclass
class SampleRequest:
    prompt: str  # the text of this request (for a later turn: only the new user message)
    prompt_len: int  # tokens in `prompt` by the benchmark's tokenizer, without special tokens
    expected_output_len: int  # sent as max_tokens
    category: str = "default"  # long/short, turn number...: the report breaks metrics down by it


@dataclass
class Session:
    turns: list[SampleRequest]
    timestamp: float | None = None  # seconds after the start (trace replay); None: the arrival process decides


@dataclass
class WorkloadConfig:
    """Every dataset's knobs; each generator reads only its own."""

    dataset_name: str = "random"
    num_prompts: int = 100
    seed: int = 0
    # random
    random_input_len: int = 1024
    random_output_len: int = 128
    random_range_ratio: float = 0.0
    random_prefix_len: int = 0
    # synthetic_chat: lognormal lengths like ShareGPT's (after the usual filter: 4 <= input <= 1024, total <= 2048)
    synthetic_chat_input_len: int = 220
    synthetic_chat_output_len: int = 200
    synthetic_chat_sigma: float = 0.9
    synthetic_chat_max_len: int = 2048
    # prefix_repetition (shared prefix)
    prefix_repetition_num_prefixes: int = 10
    prefix_repetition_prefix_len: int = 256
    prefix_repetition_suffix_len: int = 256
    prefix_repetition_output_len: int = 128
    # multi_turn
    multi_turn_turns: int = 4
    multi_turn_input_len: int = 128
    multi_turn_output_len: int = 64
    # long_short
    long_short_long_fraction: float = 0.05
    long_short_long_input_len: int = 4096
    long_short_long_output_len: int = 16
    long_short_short_input_len: int = 128
    long_short_short_output_len: int = 128
    # copy (copy_tasks.py): edit code, summarise with quotes, rewrite JSON
    copy_input_len: int = 512
    copy_output_len: int = 256
    # mooncake_trace
    dataset_path: str | None = None
    trace_time_scale: float = 1.0
    trace_block_size: int = 512


class TextMaker:
    """Makes text of a given token count: words that are single tokens, each with a leading space.

    With a byte-level BPE tokenizer (GPT-2 style, SmolLM2, Llama 3, Qwen) " w1 w2 ..." splits at the
    spaces first, so n such words are exactly n tokens and a shared word prefix is a shared token
    prefix. `fit` corrects the count for tokenizers where that does not hold.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.words = _word_pool(tokenizer)

    def count(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=False))

    def draw(self, rng: np.random.Generator, n: int) -> list[str]:
        return [self.words[i] for i in rng.integers(0, len(self.words), max(n, 0))]

    def text(self, rng: np.random.Generator, n: int) -> str:
        return join_words(self.draw(rng, n))

    def fit(self, words: list[str], target: int, rng: np.random.Generator) -> tuple[str, int]:
        """Text from `words`, trimmed or extended at the end until it counts `target` tokens."""
        words = list(words)
        text = join_words(words)
        n = self.count(text)
        for _ in range(8):
            if n == target or target <= 0:
                break
            if n > target:
                # Drop about as many words as there are surplus tokens (never all of them).
                del words[max(len(words) - (n - target), 1):]
            else:
                words += self.draw(rng, target - n)
            text = join_words(words)
            n = self.count(text)
        return text, n


def join_words(words: Sequence[str]) -> str:
    return "".join(" " + w for w in words)


# Keyed by identity; the tokenizer is kept alive in the entry so its id cannot be reused by another.
_pool_cache: dict[int, tuple[Tokenizer, list[str]]] = {}


def _word_pool(tokenizer: Tokenizer) -> list[str]:
    key = id(tokenizer)
    if key in _pool_cache:
        return _pool_cache[key][1]
    words: list[str] = []
    vocab = len(tokenizer)
    chunk = 4096
    for lo in range(0, vocab, chunk):
        ids = list(range(lo, min(lo + chunk, vocab)))
        strs = [tokenizer.decode([i]) for i in ids]
        cands = [(i, s[1:]) for i, s in zip(ids, strs, strict=True)
                 if s.startswith(" ") and len(s) >= 3 and s[1:].isascii() and s[1:].isalpha()]
        words += [w for i, w in cands if tokenizer.encode(" " + w, add_special_tokens=False) == [i]]
        if len(words) >= WORD_POOL_SIZE:
            break
    if len(words) < 64:
        # A tokenizer whose decode drops the leading space (SentencePiece): take alphabetic tokens
        # and let TextMaker.fit fix the counts.
        strs = [tokenizer.decode([i]).strip() for i in range(min(vocab, 8 * WORD_POOL_SIZE))]
        words = [s for s in strs if len(s) >= 2 and s.isascii() and s.isalpha()]
    if not words:
        raise ValueError("cannot build prompts with this tokenizer: no plain-word tokens in its vocabulary")
    words = words[:WORD_POOL_SIZE]
    _pool_cache[key] = (tokenizer, words)
    return words


# -- generators ----------------------------------------------------------------------------------

def _lengths(rng: np.random.Generator, n: int, mean: int, ratio: float, low: int) -> np.ndarray:
    """Uniform integers in [mean * (1 - ratio), mean * (1 + ratio)], at least `low`."""
    if not 0 <= ratio < 1:
        raise ValueError(f"random_range_ratio must be in [0, 1), got {ratio}")
    lo = max(int(np.floor(mean * (1 - ratio))), low)
    hi = max(int(np.ceil(mean * (1 + ratio))), lo)
    return rng.integers(lo, hi + 1, n)


def _single(text: str, n: int, out: int, category: str = "default") -> Session:
    return Session([SampleRequest(text, n, int(out), category)])


def gen_random(cfg: WorkloadConfig, maker: TextMaker) -> list[Session]:
    rng = np.random.default_rng(cfg.seed)
    in_lens = _lengths(rng, cfg.num_prompts, cfg.random_input_len, cfg.random_range_ratio, 1)
    out_lens = _lengths(rng, cfg.num_prompts, cfg.random_output_len, cfg.random_range_ratio, 1)
    prefix = maker.draw(rng, cfg.random_prefix_len)
    sessions = []
    for n_in, n_out in zip(in_lens, out_lens, strict=True):
        target = cfg.random_prefix_len + int(n_in)
        text, n = maker.fit(prefix + maker.draw(rng, int(n_in)), target, rng)
        sessions.append(_single(text, n, n_out))
    return sessions


def _lognormal(rng: np.random.Generator, n: int, mean: float, sigma: float) -> np.ndarray:
    # Parameterised by the mean (before clipping), which is what people quote for a dataset.
    mu = np.log(max(mean, 1.0)) - sigma * sigma / 2
    return np.rint(rng.lognormal(mu, sigma, n)).astype(int)


def gen_synthetic_chat(cfg: WorkloadConfig, maker: TextMaker, category: str = "default") -> list[Session]:
    rng = np.random.default_rng(cfg.seed)
    max_len = cfg.synthetic_chat_max_len
    in_lens = np.clip(_lognormal(rng, cfg.num_prompts, cfg.synthetic_chat_input_len, cfg.synthetic_chat_sigma),
                      4, max(max_len // 2, 4))
    out_lens = _lognormal(rng, cfg.num_prompts, cfg.synthetic_chat_output_len, cfg.synthetic_chat_sigma)
    out_lens = np.clip(out_lens, 4, np.maximum(max_len - in_lens, 4))
    sessions = []
    for n_in, n_out in zip(in_lens, out_lens, strict=True):
        text, n = maker.fit(maker.draw(rng, int(n_in)), int(n_in), rng)
        sessions.append(_single(text, n, n_out, category))
    return sessions


def gen_prefix_repetition(cfg: WorkloadConfig, maker: TextMaker) -> list[Session]:
    if cfg.prefix_repetition_num_prefixes < 1:
        raise ValueError("prefix_repetition_num_prefixes must be at least 1")
    rng = np.random.default_rng(cfg.seed)
    prefixes = [maker.draw(rng, cfg.prefix_repetition_prefix_len) for _ in range(cfg.prefix_repetition_num_prefixes)]
    target = cfg.prefix_repetition_prefix_len + cfg.prefix_repetition_suffix_len
    sessions = []
    for i in range(cfg.num_prompts):
        k = i % len(prefixes)
        text, n = maker.fit(prefixes[k] + maker.draw(rng, cfg.prefix_repetition_suffix_len), target, rng)
        sessions.append(_single(text, n, cfg.prefix_repetition_output_len, f"prefix{k}"))
    # Interleave the groups so equal prefixes do not arrive back to back.
    return [sessions[i] for i in rng.permutation(len(sessions))]


def gen_multi_turn(cfg: WorkloadConfig, maker: TextMaker) -> list[Session]:
    """`num_prompts` conversations of `multi_turn_turns` user turns; the history grows with the real replies."""
    if cfg.multi_turn_turns < 1:
        raise ValueError("multi_turn_turns must be at least 1")
    rng = np.random.default_rng(cfg.seed)
    sessions = []
    for _ in range(cfg.num_prompts):
        turns = []
        for t in range(cfg.multi_turn_turns):
            text, n = maker.fit(maker.draw(rng, cfg.multi_turn_input_len), cfg.multi_turn_input_len, rng)
            turns.append(SampleRequest(text, n, cfg.multi_turn_output_len, f"turn{t + 1}"))
        sessions.append(Session(turns))
    return sessions


def gen_long_short(cfg: WorkloadConfig, maker: TextMaker) -> list[Session]:
    """Short chats with a fraction of very long prompts: long prefills stall the short ones' decodes."""
    if not 0 <= cfg.long_short_long_fraction <= 1:
        raise ValueError("long_short_long_fraction must be in [0, 1]")
    rng = np.random.default_rng(cfg.seed)
    n_long = int(round(cfg.long_short_long_fraction * cfg.num_prompts))
    long_at = set(rng.choice(cfg.num_prompts, n_long, replace=False).tolist()) if n_long else set()
    sessions = []
    for i in range(cfg.num_prompts):
        if i in long_at:
            n_in, n_out, cat = cfg.long_short_long_input_len, cfg.long_short_long_output_len, "long"
        else:
            n_in, n_out, cat = cfg.long_short_short_input_len, cfg.long_short_short_output_len, "short"
        text, n = maker.fit(maker.draw(rng, n_in), n_in, rng)
        sessions.append(_single(text, n, n_out, cat))
    return sessions


def gen_copy(cfg: WorkloadConfig, maker: TextMaker) -> list[Session]:
    """num_prompts prompts of about copy_input_len tokens (copy_tasks.py), the three tasks in turn,
    copy_output_len tokens asked for each."""
    rng = np.random.default_rng(cfg.seed)
    sessions = []
    for i in range(cfg.num_prompts):
        task = COPY_TASKS[i % len(COPY_TASKS)]
        text = copy_prompt(task, rng, maker.count, cfg.copy_input_len)
        sessions.append(_single(text, maker.count(text), cfg.copy_output_len, task))
    return sessions


def read_trace(path: str | Path) -> list[dict[str, Any]]:
    rows = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            missing = {"input_length", "output_length"} - row.keys()
            if missing:
                raise ValueError(f"{path}:{lineno}: missing {sorted(missing)}")
            rows.append(row)
    return rows


def block_words(maker: TextMaker, seed: int, hash_id: int, block_size: int) -> list[str]:
    """A trace block's words depend only on (seed, hash_id): equal hash ids give equal prompt prefixes."""
    return maker.draw(np.random.default_rng([seed, int(hash_id)]), block_size)


def gen_mooncake_trace(cfg: WorkloadConfig, maker: TextMaker) -> list[Session]:
    """Replay a Mooncake-format JSONL trace: timestamp (ms), input_length, output_length, hash_ids."""
    if cfg.dataset_path is None:
        raise ValueError("mooncake_trace needs --dataset-path")
    rows = read_trace(cfg.dataset_path)[: cfg.num_prompts]
    if not rows:
        raise ValueError(f"{cfg.dataset_path} has no requests")
    t0 = min(float(r.get("timestamp", 0)) for r in rows)
    bs = cfg.trace_block_size
    sessions = []
    for i, row in enumerate(rows):
        n_in = int(row["input_length"])
        words: list[str] = []
        for h in row.get("hash_ids", []):
            words += block_words(maker, cfg.seed, h, bs)
        words = words[:n_in]
        if len(words) < n_in:
            # Tokens beyond the hashed blocks belong to this request alone.
            words += maker.draw(np.random.default_rng([cfg.seed, 1 << 62, i]), n_in - len(words))
        text, n = maker.fit(words, n_in, np.random.default_rng([cfg.seed, 1 << 63, i]))
        ts = (float(row.get("timestamp", 0)) - t0) / 1000.0 * cfg.trace_time_scale
        sessions.append(Session([SampleRequest(text, n, int(row["output_length"]))], timestamp=ts))
    # The arrival loop expects sessions in time order; a trace need not be sorted.
    sessions.sort(key=lambda s: s.timestamp or 0.0)
    return sessions


_GENERATORS = {
    "random": gen_random,
    "synthetic_chat": gen_synthetic_chat,
    "prefix_repetition": gen_prefix_repetition,
    "multi_turn": gen_multi_turn,
    "long_short": gen_long_short,
    "mooncake_trace": gen_mooncake_trace,
    "copy": gen_copy,
}


def generate(cfg: WorkloadConfig, tokenizer: Tokenizer | TextMaker) -> list[Session]:
    if cfg.dataset_name not in _GENERATORS:
        raise ValueError(f"unknown dataset {cfg.dataset_name!r}; choose from {', '.join(DATASETS)}")
    if cfg.num_prompts < 1:
        raise ValueError("num_prompts must be at least 1")
    maker = tokenizer if isinstance(tokenizer, TextMaker) else TextMaker(tokenizer)
    return _GENERATORS[cfg.dataset_name](cfg, maker)


def num_requests(sessions: list[Session]) -> int:
    return sum(len(s.turns) for s in sessions)

