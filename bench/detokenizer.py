"""Incremental detokenizing cost per token: the engine's `Detokenizer` (tokenizers' DecodeStream, one Rust call
per token) against the method it replaced, measured in the same run (two `Tokenizer.decode` calls per token: the
held-back prefix and the whole window, the text being their difference).

Both decode the same streams (SmolLM2's tokenizer over a fixed English text with accents and an emoji, each stream
starting at another token) and must produce the same text.
Medians over rounds; the ratio is baseline / Detokenizer (above 1: the engine's is faster).

    python bench/detokenizer.py [--tokens 2000] [--streams 32] [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

from tokenizers import Tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from server.engine.config import DEFAULT_MODEL  # noqa: E402
from server.engine.detokenizer import Detokenizer  # noqa: E402
from server.engine.loader import prepare_model  # noqa: E402

REPLACEMENT = "\ufffd"
TEXT = (
    "Paged attention keeps the KV cache in fixed-size blocks, so a request's cache can grow one block at a time "
    "without copying; prefix caching finds blocks by the hash of their tokens — déjà vu for a second turn, "
    "ünïcödé and emoji 🚀 included. "
)


class TwoDecodes:
    """The baseline: decode(prefix) and decode(window) per token (vLLM's older incremental detokenizer)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer, self.ids, self.prefix_offset, self.read_offset, self.text = tokenizer, [], 0, 0, ""

    def add_token(self, token_id: int) -> bool:
        self.ids.append(token_id)
        prefix = self.tokenizer.decode(self.ids[self.prefix_offset : self.read_offset])
        full = self.tokenizer.decode(self.ids[self.prefix_offset :])
        if len(full) <= len(prefix) or full.endswith(REPLACEMENT):
            return False
        self.text += full[len(prefix) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        return False


def streams(tokenizer: Tokenizer, count: int, tokens: int) -> list[list[int]]:
    ids = tokenizer.encode(TEXT * (tokens // 40 + 1)).ids
    rng = random.Random(0)
    return [ids[offset : offset + tokens] for offset in (rng.randrange(0, 40) for _ in range(count))]


def time_one(make, token_streams: list[list[int]]) -> tuple[float, list[str]]:
    """Seconds per token, and the texts."""
    started = time.perf_counter()
    decoders = [make() for _ in token_streams]
    for decoder, ids in zip(decoders, token_streams, strict=True):
        for token_id in ids:
            decoder.add_token(token_id)
    elapsed = time.perf_counter() - started
    return elapsed / sum(map(len, token_streams)), [d.text for d in decoders]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=2000, help="tokens per stream")
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    tokenizer = Tokenizer.from_file(str(prepare_model(DEFAULT_MODEL).folder / "tokenizer.json"))
    token_streams = streams(tokenizer, args.streams, args.tokens)
    ours, base = [], []
    for _ in range(args.rounds):  # alternating, so machine noise hits both alike
        seconds, texts = time_one(lambda: Detokenizer(tokenizer, []), token_streams)
        ours.append(seconds)
        base_seconds, base_texts = time_one(lambda: TwoDecodes(tokenizer), token_streams)
        base.append(base_seconds)
        if texts != base_texts:
            raise SystemExit("the two detokenizers disagree on the text")
    result = {
        "bench": "detokenizer", "tokens_per_stream": args.tokens, "streams": args.streams, "rounds": args.rounds,
        "decode_stream_us_per_token": round(statistics.median(ours) * 1e6, 2),
        "two_decodes_us_per_token": round(statistics.median(base) * 1e6, 2),
    }  # fmt: skip
    result["ratio"] = round(result["two_decodes_us_per_token"] / result["decode_stream_us_per_token"], 2)
    print("| detokenizer | us per token (median) |\n| --- | --- |")
    print(f"| DecodeStream (engine) | {result['decode_stream_us_per_token']} |")
    print(f"| two decodes (baseline) | {result['two_decodes_us_per_token']} |")
    print(f"ratio baseline / engine: {result['ratio']}")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
