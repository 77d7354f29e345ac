"""Suffix matching over token arrays: the one search both proposers run.

A request's history (prompt and output) is an int32 array; the shared history of a tenant's recent
outputs is one array of several sequences separated by SEP. "Where did the last m tokens occur
before, and what followed them?" is answered by narrowing the positions of the last token one
older token at a time (vectorised), which visits each candidate once per match length: a suffix
tree's answer, without holding a tree per request.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

SEP = -1  # between sequences of a shared history: no match or continuation crosses it


class TokenArray:
    """A growable int32 copy of a token sequence (or of several, with SEP between them)."""

    def __init__(self, capacity: int = 256) -> None:
        self._buf = np.empty(capacity, dtype=np.int32)
        self.size = 0

    def extend(self, tokens: Sequence[int] | np.ndarray) -> None:
        n = len(tokens)
        if self.size + n > len(self._buf):
            grown = np.empty(max(2 * len(self._buf), self.size + n), dtype=np.int32)
            grown[:self.size] = self._buf[:self.size]
            self._buf = grown
        self._buf[self.size:self.size + n] = tokens
        self.size += n

    def sync(self, tokens: Sequence[int]) -> np.ndarray:
        """Append what tokens has beyond the copy (a request's tokens only grow); returns the view."""
        if len(tokens) > self.size:
            self.extend(tokens[self.size:])
        return self.view

    def drop_front(self, n: int) -> None:
        self._buf[:self.size - n] = self._buf[n:self.size].copy()
        self.size -= n

    @property
    def view(self) -> np.ndarray:
        return self._buf[:self.size]


def suffix_matches(history: np.ndarray, pattern: np.ndarray, max_len: int) -> tuple[int, np.ndarray]:
    """The longest m <= max_len such that pattern's last m tokens occur in history followed by a token
    (not SEP), and the index after each such occurrence (where its continuation starts). (0, empty)
    when the last token never occurs with a continuation. When pattern is history's own suffix, its
    occurrence at the very end has no continuation and is not counted."""
    n = len(history)
    if n < 2 or not len(pattern) or max_len < 1:
        return 0, np.empty(0, dtype=np.int64)
    ends = np.flatnonzero(history[:n - 1] == pattern[-1]) + 1
    ends = ends[history[ends] != SEP]
    if not ends.size:
        return 0, ends
    m = 1
    while m < min(max_len, len(pattern)):
        before = ends - m - 1
        ends_ok = ends[before >= 0]
        longer = ends_ok[history[before[before >= 0]] == pattern[-m - 1]]
        if not longer.size:
            break
        ends, m = longer, m + 1
    return m, ends


def frequent_continuation(history: np.ndarray, ends: np.ndarray, max_tokens: int,
                          min_prob: float) -> tuple[list[int], float]:
    """Walk on from the occurrences at `ends`, taking each time the token that most of them continue
    with and keeping only those: a suffix tree's most frequent path. Stops when the path's estimated
    probability (the product of each choice's share) falls below min_prob. Returns the tokens and the
    sum of their estimated probabilities (the expected number accepted)."""
    tokens: list[int] = []
    prob, expected = 1.0, 0.0
    n = len(history)
    while len(tokens) < max_tokens:
        ends = ends[ends < n]
        if not ends.size:
            break
        if ends.size == 1:  # one occurrence: what followed it, as far as it goes
            run = _run(history, int(ends[0]), max_tokens - len(tokens))
            tokens += run
            expected += prob * len(run)
            break
        following = history[ends]
        if (following == following[0]).all():
            best_token, share = int(following[0]), 1.0
        else:
            values, counts = np.unique(following, return_counts=True)
            best = int(counts.argmax())
            best_token, share = int(values[best]), counts[best] / ends.size
        if best_token == SEP:
            break
        prob *= share
        if prob < min_prob:
            break
        tokens.append(best_token)
        expected += prob
        ends = ends[following == best_token] + 1
    return tokens, expected


def _run(history: np.ndarray, start: int, limit: int) -> list[int]:
    """Up to limit tokens from start, never past SEP."""
    run = history[start:start + limit]
    stop = np.flatnonzero(run == SEP)
    return run[:stop[0] if stop.size else len(run)].tolist()
