"""The rules of bench/chaos.py, apart from the processes it runs: which worker to kill, the spans with no live
worker, which RSS growth counts, and the malformed requests it sends (tests/harness/test_chaos.py checks them)."""

from __future__ import annotations

import json
import random
import threading
from typing import Any

MODEL = "smollm2"
REMOTE_ID = "chaos-remote"  # the one `strata worker`; every other worker id is one of `strata serve`'s own


class Liveness:
    """The workers that can serve, as the bench knows it (bench/chaos.py's docstring), and the spans with none."""

    def __init__(self, workers: set[str], now: float) -> None:
        self._alive = set(workers)
        self._lock = threading.Lock()
        self.outages: list[list[float]] = []  # [start, end] monotonic s; end is inf while it lasts

    def alive(self) -> set[str]:
        with self._lock:
            return set(self._alive)

    def join(self, worker_id: str, now: float) -> None:
        with self._lock:
            if not self._alive and self.outages:
                self.outages[-1][1] = now
            self._alive.add(worker_id)

    def leave(self, worker_id: str, now: float) -> None:
        with self._lock:
            self._alive.discard(worker_id)
            if not self._alive and (not self.outages or self.outages[-1][1] != float("inf")):
                self.outages.append([now, float("inf")])

    def overlaps_outage(self, start: float, end: float) -> bool:
        with self._lock:
            return any(s <= end and start <= e for s, e in self.outages)


def pick_victim(alive: set[str], kill_last: bool, rng: random.Random) -> str | None:
    """A random live worker to kill; unless `kill_last`, never the last live one nor the last local one (local
    workers are not restarted)."""
    candidates = sorted(alive)
    if not kill_last:
        if len(candidates) <= 1:
            return None
        local = [w for w in candidates if w != REMOTE_ID]
        if len(local) == 1:
            candidates.remove(local[0])
    return rng.choice(candidates) if candidates else None


def rss_growth(baseline: dict[str, Any], end: dict[str, Any]) -> dict[str, float]:
    """Per role whose pids are the same at both samples: RSS growth from `baseline` to `end` (a fraction)."""
    growth = {}
    for role, first in baseline["processes"].items():
        last = end["processes"].get(role)
        if last is not None and last["pids"] == first["pids"] and first["rss_mib"] > 0:
            growth[role] = round(last["rss_mib"] / first["rss_mib"] - 1, 4)
    return growth


def malformed_requests(oversized_mb: float) -> list[tuple[str, str, bytes]]:
    """(kind, path, body) of each malformed request; every one must be answered with a 4xx."""
    good = {"model": MODEL, "prompt": "Hello", "max_tokens": 4}

    def body(**changes: Any) -> bytes:
        return json.dumps(good | changes).encode()

    completions, chat = "/v1/completions", "/v1/chat/completions"
    oversized = [
        (f"body of {oversized_mb:g} MiB", completions, body(prompt="x " * int(oversized_mb * 2**19)))
    ]
    return [
        ("bad JSON", completions, b'{"model": "smollm2", "prompt": "Hello",'),
        ("not an object", completions, b"[1, 2, 3]"),
        ("prompt of a wrong type", completions, body(prompt={"text": "Hello"})),
        ("max_tokens a string", completions, body(max_tokens="four")),
        ("messages a string", chat, json.dumps({"model": MODEL, "messages": "Hello"}).encode()),
        ("temperature -1", completions, body(temperature=-1)),
        ("temperature Infinity", completions, body(temperature=1).replace(b"1}", b"Infinity}")),
        ("top_p 1.5", completions, body(top_p=1.5)),
        ("top_k -7", completions, body(top_k=-7)),
        ("max_tokens 0", completions, body(max_tokens=0)),
        ("max_tokens 10^9", completions, body(max_tokens=10**9)),
        ("n 0", completions, body(n=0)),
        ("stop_token_ids outside the vocabulary", completions, body(stop_token_ids=[10**9], min_tokens=2)),
        ("token id outside the vocabulary", completions, body(prompt=[10**9])),
        ("negative token id", completions, body(prompt=[-1])),
        ("unknown model", completions, body(model="no-such-model")),
        ("prompt of 1 MiB of text", completions, body(prompt="x " * 2**19)),
    ] + (oversized if oversized_mb > 0 else [])
