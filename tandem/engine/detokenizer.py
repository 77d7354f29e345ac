"""Incremental detokenization that is right across multi-byte UTF-8 characters, and stop strings.

A token can end in the middle of a UTF-8 character (byte-level BPE), so text is only released
once the decoded tail no longer ends in U+FFFD. Decoding restarts a few tokens back each time
(prefix/read offsets) so that tokenizers that merge spaces across tokens still come out right.
"""

from __future__ import annotations

from typing import Any

_CONTEXT_TOKENS = 5  # prompt tokens decoded with the output so leading-space rules apply


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], skip_special_tokens: bool) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def add(self, token_ids: list[int], final: bool = False) -> str:
        """Append tokens; returns the newly decoded text (which may be empty while a character is
        incomplete). With final=True, whatever is pending is released as is."""
        self.ids.extend(token_ids)
        prefix_text = self._decode(self.ids[self.prefix_offset:self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset:])
        if len(new_text) > len(prefix_text) and (final or not new_text.endswith("\ufffd")):
            delta = new_text[len(prefix_text):]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            self.text += delta
            return delta
        return ""


def find_stop(text: str, new_len: int, stops: list[str]) -> tuple[int, str] | None:
    """Earliest stop string that ends inside the last new_len characters of text: (start, stop)."""
    best: tuple[int, str] | None = None
    for stop in stops:
        start = text.find(stop, max(len(text) - new_len - len(stop) + 1, 0))
        if start != -1 and (best is None or start < best[0]):
            best = (start, stop)
    return best
