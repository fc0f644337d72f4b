"""Incremental detokenization with stop strings.

Text comes from tokenizers' `DecodeStream`, one Rust call per token, which yields a piece only once it decodes to
complete characters (a byte-level BPE token can end mid UTF-8 sequence). With stop strings, the last
`len(longest stop) - 1` characters are held back, so a stop string that spans tokens is never partly emitted; the
text before a stop string is emitted, the stop string itself only with `include_stop` (vLLM's
include_stop_str_in_output). Special tokens (EOS) add no text unless `skip_special_tokens` is False.
"""

from __future__ import annotations

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream


class Detokenizer:
    """Per-request decoder state. `text` is everything decoded so far; `num_emitted` chars of it were sent."""

    __slots__ = ("tokenizer", "stream", "stops", "include_stop", "hold", "text", "num_emitted")

    def __init__(
        self,
        tokenizer: Tokenizer,
        stops: list[str],
        skip_special_tokens: bool = True,
        include_stop: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        self.stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self.stops = stops
        self.include_stop = include_stop
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.text = ""
        self.num_emitted = 0

    def add_token(self, token_id: int) -> bool:
        """Decode one more output token; True if a stop string appeared (text is cut before it)."""
        piece = self.stream.step(self.tokenizer, token_id)
        if not piece:
            return False
        start = max(0, len(self.text) - self.hold)
        self.text += piece
        return bool(self.stops) and self._cut_at_stop(start)

    def _cut_at_stop(self, start: int) -> bool:
        found = [(pos, len(stop)) for stop in self.stops if (pos := self.text.find(stop, start)) >= 0]
        if not found:
            return False
        pos, length = min(found)
        self.text = self.text[: pos + length if self.include_stop else pos]
        return True

    def take_text(self, finished: bool) -> str:
        """New text safe to send now; everything that is left when `finished`."""
        end = len(self.text) if finished else max(self.num_emitted, len(self.text) - self.hold)
        delta = self.text[self.num_emitted : end]
        self.num_emitted = end
        return delta
