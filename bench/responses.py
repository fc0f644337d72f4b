"""Multi-turn conversations through /v1/responses (previous_response_id chains) against the same conversations sent
as whole chat histories to /v1/chat/completions, on one `strata serve` with SmolLM2 (float32).

Each round replays --conversations conversations of --turns user turns on each side (the side that goes first
alternates by round); every conversation starts with its own system text, so no side reuses the other's blocks.
Turn n+1 of a Responses conversation sends only the new user turn and the previous response's id; of a chat
conversation, the whole history with the answers chat gave. Both stream, greedy, --tokens tokens a turn. Reported,
over turns 2..n: the prefix hit rate (cached prompt tokens / prompt tokens, from usage) and the median TTFT (first
text delta), medians over rounds. Goals: the same hit rate, Responses' TTFT within 1.05x of chat's.

    python bench/responses.py [--rounds 3] [--conversations 4] [--turns 4] [--tokens 24]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import openai

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: server, kvbm, harness
from bench.machine import cores, cpu_name  # noqa: E402
from harness.servers import copy_models, start_strata, use_run_secret  # noqa: E402

QUESTIONS = [
    "Name one river in Europe.",
    "How long is it, roughly?",
    "Which cities does it pass through?",
    "Tell me one more fact about it.",
    "Summarise our conversation in one sentence.",
    "Thank you. Anything else worth knowing?",
]
TTFT_GOAL = 1.05


class Turn:
    def __init__(self, ttft: float, prompt: int, cached: int) -> None:
        self.ttft, self.prompt, self.cached = ttft, prompt, cached


def responses_conversation(api: openai.OpenAI, system: str, turns: int, tokens: int) -> list[Turn]:
    out, previous = [], None
    for question in QUESTIONS[:turns]:
        start, ttft = time.perf_counter(), None
        with api.responses.stream(
            model="smollm2", instructions=system, input=question, previous_response_id=previous,
            max_output_tokens=tokens, temperature=0,
        ) as stream:  # fmt: skip
            for event in stream:
                if ttft is None and event.type == "response.output_text.delta":
                    ttft = time.perf_counter() - start
                if event.type in ("response.completed", "response.incomplete"):  # cut at max_output_tokens
                    final = event.response
        previous = final.id
        usage = final.usage
        out.append(Turn(ttft or float("nan"), usage.input_tokens, usage.input_tokens_details.cached_tokens))
    return out


def chat_conversation(api: openai.OpenAI, system: str, turns: int, tokens: int) -> list[Turn]:
    out, messages = [], [{"role": "system", "content": system}]
    for question in QUESTIONS[:turns]:
        messages.append({"role": "user", "content": question})
        start, ttft, text, usage = time.perf_counter(), None, [], None
        for chunk in api.chat.completions.create(
            model="smollm2", messages=messages, max_tokens=tokens, temperature=0, stream=True,
            stream_options={"include_usage": True},
        ):  # fmt: skip
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                if choice.delta.content:
                    ttft = ttft if ttft is not None else time.perf_counter() - start
                    text.append(choice.delta.content)
        messages.append({"role": "assistant", "content": "".join(text)})
        assert usage is not None
        out.append(Turn(ttft or float("nan"), usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens))
    return out


def summarise(conversations: list[list[Turn]]) -> dict[str, float]:
    later = [turn for conversation in conversations for turn in conversation[1:]]
    return {
        "hit_rate": sum(t.cached for t in later) / sum(t.prompt for t in later),
        "ttft_p50": statistics.median(t.ttft for t in later),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--conversations", type=int, default=4)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=24, help="tokens an answer")
    args = parser.parse_args()
    use_run_secret()
    sides = {"responses": responses_conversation, "chat": chat_conversation}
    rounds: list[dict[str, dict[str, float]]] = []
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        server = start_strata(copy_models(tmp / "repo", "smollm2"), tmp)
        try:
            api = openai.OpenAI(base_url=f"{server.openai_url}/v1", api_key="unused", max_retries=0)
            chat_conversation(api, "Warm-up.", 1, 4)
            for index in range(args.rounds):
                order = ["responses", "chat"] if index % 2 == 0 else ["chat", "responses"]
                result = {}
                for side in order:
                    conversations = [
                        sides[side](api, f"Conversation {side}-{index}-{c}. You are a concise assistant.",
                                    args.turns, args.tokens)
                        for c in range(args.conversations)
                    ]  # fmt: skip
                    result[side] = summarise(conversations)
                rounds.append(result)
        finally:
            server.stop()
    cells = {
        side: {key: statistics.median(r[side][key] for r in rounds) for key in ("hit_rate", "ttft_p50")}
        for side in sides
    }
    ratio = cells["responses"]["ttft_p50"] / cells["chat"]["ttft_p50"]
    cpu = f"{cpu_name()}, {cores()} cores"
    print(f"\n{cpu}; SmolLM2 float32; {args.rounds} rounds, medians; {args.conversations} conversations x "
          f"{args.turns} turns a side, {args.tokens} tokens an answer; turns 2..{args.turns}")  # fmt: skip
    print(f"{'side':12} {'prefix hit rate':>16} {'TTFT p50 s':>12}")
    for side, cell in cells.items():
        print(f"{side:12} {cell['hit_rate']:>16.3f} {cell['ttft_p50']:>12.4f}")
    print(f"TTFT responses / chat: {ratio:.3f} (goal <= {TTFT_GOAL}); hit rates {cells['responses']['hit_rate']:.3f} "
          f"vs {cells['chat']['hit_rate']:.3f}")  # fmt: skip
    summary = {"bench": "responses", "cpu": cpu, "rounds": args.rounds, "conversations": args.conversations}
    summary |= {"turns": args.turns, "tokens": args.tokens, "cells": cells, "ttft_ratio": round(ratio, 3)}
    summary |= {
        "met": ratio <= TTFT_GOAL and cells["responses"]["hit_rate"] >= cells["chat"]["hit_rate"] - 0.01
    }
    summary |= {"per_round": rounds}
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
