"""How many prefill and decode workers a predicted load needs to meet a TTFT and an ITL target: the arithmetic of
an SLA planner (Dynamo's), on a profile of what one worker does on this hardware.

Profile (`WorkerProfile`, measured by running one worker alone):
    prefill  TTFT of one request against its prompt length  -> a worker's prefill throughput at that length
    decode   ITL against the number of streams decoding together and their context length

Prefill workers: one worker serves prompts of `prompt_tokens` in S = ttft(prompt_tokens) seconds each. Arrivals
queue, so a worker cannot be kept busy all the time and still meet the target: as an M/D/1 queue, the mean wait
at utilisation rho is rho * S / (2 (1 - rho)); TTFT = wait + S <= target holds up to

    rho_max = 2 (T - S) / (2T - S)          (0 when S >= T: no number of workers meets the target)

so one worker carries rho_max * prompt_tokens / S prompt tokens per second, and the load needs
ceil((rate * prompt_tokens + queued_prompt_tokens / interval) / that) workers. Queued prompt tokens count as
load at once: a burst that fills the queues scales prefill up before any TTFT sample reports it.

Decode workers: at context C = prompt_tokens + output_tokens / 2 (the mean over a stream's life), the largest
measured concurrency whose ITL meets the target gives a worker's decode throughput, concurrency / ITL tokens per
second; the load needs ceil(rate * output_tokens / that) workers.

Aggregated workers (one role) do both: each request costs prompt_tokens / prefill capacity plus output_tokens /
decode capacity worker-seconds, so the load needs ceil(rate * that) workers.

Counts are clamped to each role's [min, max], then to the total budget (shared in proportion to need, each role
keeping its minimum).
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class PrefillPoint:
    prompt_tokens: int
    ttft_s: float  # one request alone on the worker


@dataclass(frozen=True, slots=True)
class DecodePoint:
    concurrency: int  # streams decoding together
    context_tokens: int  # each stream's context (prompt + generated so far)
    itl_s: float


@dataclass(frozen=True, slots=True)
class WorkerProfile:
    prefill: tuple[PrefillPoint, ...]
    decode: tuple[DecodePoint, ...]

    def __post_init__(self) -> None:
        if not self.prefill or not self.decode:
            raise ValueError("a worker profile needs prefill and decode points")
        if len({p.prompt_tokens for p in self.prefill}) < len(self.prefill):
            raise ValueError("a worker profile has two prefill points for one prompt length")
        if len({(p.concurrency, p.context_tokens) for p in self.decode}) < len(self.decode):
            raise ValueError("a worker profile has two decode points for one concurrency and context")

    def ttft(self, prompt_tokens: float) -> float:
        """TTFT of one prompt alone, linear between measured lengths (and beyond them, from the nearest two)."""
        points = sorted((p.prompt_tokens, p.ttft_s) for p in self.prefill)
        return _interpolate(points, prompt_tokens)

    def itl(self, concurrency: int, context_tokens: float) -> float | None:
        """ITL at a measured concurrency, linear in context between measured contexts; None if not measured."""
        points = sorted((p.context_tokens, p.itl_s) for p in self.decode if p.concurrency == concurrency)
        return _interpolate(points, context_tokens) if points else None

    def itl_at(self, concurrency: float, context_tokens: float) -> float:
        """ITL at any concurrency: linear between the measured ones (at this context), flat below the smallest."""
        points = []
        for measured in sorted({p.concurrency for p in self.decode}):
            itl = self.itl(measured, context_tokens)
            if itl is not None:
                points.append((float(measured), itl))
        return _interpolate(points, max(concurrency, points[0][0]))

    def scaled(self, prefill_factor: float, decode_factor: float) -> WorkerProfile:
        """This profile with every TTFT times `prefill_factor` and every ITL times `decode_factor`: the planner's
        correction for a deployment slower (or faster) than the profile says (interference, other load)."""
        return WorkerProfile(
            tuple(PrefillPoint(p.prompt_tokens, p.ttft_s * prefill_factor) for p in self.prefill),
            tuple(DecodePoint(d.concurrency, d.context_tokens, d.itl_s * decode_factor) for d in self.decode),
        )

    def prefill_capacity(self, prompt_tokens: float, ttft_target_s: float) -> float:
        """Prompt tokens per second one worker carries while its mean TTFT meets the target (0: it cannot)."""
        service = self.ttft(prompt_tokens)
        if service >= ttft_target_s:
            return 0.0
        rho_max = 2 * (ttft_target_s - service) / (2 * ttft_target_s - service)
        return rho_max * prompt_tokens / service

    def decode_capacity(self, context_tokens: float, itl_target_s: float) -> float:
        """Output tokens per second one worker generates at the largest measured concurrency meeting the ITL
        target (0: not even one stream does)."""
        best = 0.0
        for concurrency in sorted({p.concurrency for p in self.decode}):
            itl = self.itl(concurrency, context_tokens)
            if itl is not None and itl <= itl_target_s:
                best = max(best, concurrency / itl)
        return best


@dataclass(frozen=True, slots=True)
class Load:
    """A (predicted) interval's load: mean request rate and lengths, and prompt tokens waiting in queues now."""

    request_rate: float  # requests per second
    prompt_tokens: float  # mean
    output_tokens: float  # mean
    queued_prompt_tokens: float = 0.0


@dataclass(frozen=True, slots=True)
class Targets:
    ttft_s: float
    itl_s: float


@dataclass(frozen=True, slots=True)
class Bounds:
    min_prefill: int = 0
    max_prefill: int = 8
    min_decode: int = 1
    max_decode: int = 8
    max_total: int = 16


@dataclass(frozen=True, slots=True)
class WorkerCounts:
    prefill: int  # 0 with aggregated workers
    decode: int  # decode workers, or aggregated ones
    prefill_need: float  # unclamped, fractional: what the load needs
    decode_need: float
    reason: str  # "ok", or why the targets cannot be met / what clamped the counts


def disaggregated_workers(
    profile: WorkerProfile, load: Load, targets: Targets, bounds: Bounds, interval_s: float
) -> WorkerCounts:
    """Prefill and decode worker counts for `load` (see the module docstring)."""
    reasons = []
    prefill_tok_s = load.request_rate * load.prompt_tokens + load.queued_prompt_tokens / interval_s
    prefill_capacity = profile.prefill_capacity(load.prompt_tokens, targets.ttft_s)
    if prefill_capacity > 0:
        prefill_need = prefill_tok_s / prefill_capacity
    else:
        prefill_need, reasons = math.inf, ["ttft target below one prompt's prefill"]
    decode_capacity = profile.decode_capacity(load.prompt_tokens + load.output_tokens / 2, targets.itl_s)
    if decode_capacity > 0:
        decode_need = load.request_rate * load.output_tokens / decode_capacity
    else:
        decode_need, reasons = math.inf, [*reasons, "itl target below one stream's"]
    prefill = _clamp(prefill_need, bounds.min_prefill, bounds.max_prefill)
    decode = _clamp(decode_need, bounds.min_decode, bounds.max_decode)
    if prefill + decode > bounds.max_total:
        prefill, decode = _share(prefill, decode, bounds)
        reasons.append("total budget")
    elif _ceil(prefill_need) > prefill or _ceil(decode_need) > decode:
        reasons.append("max workers")
    return WorkerCounts(prefill, decode, prefill_need, decode_need, "; ".join(reasons) or "ok")


def aggregated_workers(
    profile: WorkerProfile, load: Load, targets: Targets, bounds: Bounds, interval_s: float
) -> WorkerCounts:
    """Aggregated worker count (`decode` of the result; prefill 0): each worker spends a request's prefill and
    its decode share of time."""
    prefill_capacity = profile.prefill_capacity(load.prompt_tokens, targets.ttft_s)
    decode_capacity = profile.decode_capacity(load.prompt_tokens + load.output_tokens / 2, targets.itl_s)
    if prefill_capacity <= 0 or decode_capacity <= 0:
        need, reason = math.inf, "targets below one request's prefill or one stream's decode"
    else:
        per_second = load.request_rate + load.queued_prompt_tokens / load.prompt_tokens / interval_s
        need = per_second * (load.prompt_tokens / prefill_capacity + load.output_tokens / decode_capacity)
        reason = "ok"
    workers = _clamp(need, bounds.min_decode, min(bounds.max_decode, bounds.max_total))
    if reason == "ok" and _ceil(need) > workers:
        reason = "max workers"
    return WorkerCounts(0, workers, 0.0, need, reason)


def _ceil(need: float) -> float:
    return math.inf if math.isinf(need) else math.ceil(need - 1e-9)  # 2.0000000001 is 2 workers


def _clamp(need: float, low: int, high: int) -> int:
    return int(max(low, min(high, _ceil(need))))


def _share(prefill: int, decode: int, bounds: Bounds) -> tuple[int, int]:
    """Cut prefill + decode to the budget in proportion, each role keeping its minimum."""
    total = prefill + decode
    prefill_share = max(bounds.min_prefill, math.floor(prefill * bounds.max_total / total))
    decode_share = max(bounds.min_decode, bounds.max_total - prefill_share)
    return prefill_share, decode_share


def _interpolate(points: list[tuple[float, float]], x: float) -> float:
    """Piecewise-linear through (x, y) points sorted by distinct x, extended linearly past both ends (never below
    0)."""
    if len(points) == 1:
        return points[0][1]
    i = min(max(bisect.bisect_right([p[0] for p in points], x), 1), len(points) - 1)
    (x0, y0), (x1, y1) = points[i - 1], points[i]
    return max(0.0, y0 + (y1 - y0) * (x - x0) / (x1 - x0))
