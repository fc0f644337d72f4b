"""Incremental detokenization with stop strings.

Text is only emitted once it decodes to complete characters (a byte-level BPE token can end mid UTF-8 sequence,
which decodes to U+FFFD until the next token completes it). With stop strings, the last `len(longest stop) - 1`
characters are held back, so a stop string that spans tokens is never partly emitted; the text before a stop
string is emitted, the stop string itself never is.
"""

from __future__ import annotations

from tokenizers import Tokenizer

REPLACEMENT = "\ufffd"


class Detokenizer:
    """Per-request decoder state. `text` is everything decoded so far; `num_emitted` chars of it were sent."""

    __slots__ = ("tokenizer", "stops", "hold", "ids", "prefix_offset", "read_offset", "text", "num_emitted")

    def __init__(self, tokenizer: Tokenizer, stops: list[str]) -> None:
        self.tokenizer = tokenizer
        self.stops = stops
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self.text = ""
        self.num_emitted = 0

    def add_token(self, token_id: int) -> bool:
        """Decode one more output token; True if a stop string appeared (text is cut before it)."""
        self.ids.append(token_id)
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset : self.read_offset])
        full = self.tokenizer.decode(self.ids[self.prefix_offset :])
        if len(full) <= len(prefix) or full.endswith(REPLACEMENT):
            return False
        start = max(0, len(self.text) - self.hold)
        self.text += full[len(prefix) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return self._cut_at_stop(start)

    def _cut_at_stop(self, start: int) -> bool:
        found = [pos for pos in (self.text.find(stop, start) for stop in self.stops) if pos >= 0]
        if not found:
            return False
        self.text = self.text[: min(found)]
        return True

    def take_text(self, finished: bool) -> str:
        """New text safe to send now; everything that is left when `finished`."""
        end = len(self.text) if finished else max(self.num_emitted, len(self.text) - self.hold)
        delta = self.text[self.num_emitted : end]
        self.num_emitted = end
        return delta
