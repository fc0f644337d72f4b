"""How fast each worker prefills and decodes, measured by the router from its requests' outputs.

prefill tok/s = uncached prompt tokens / time to first token; decode tok/s = output tokens / decode time, only
from requests that had their worker to themselves, so that queueing and batching are not mistaken for a slow
worker (an idle worker would otherwise measure fast, win more traffic, and the skew would feed itself). Each meter
starts from the speeds the worker measured at start (`WorkerInfo.speeds`), so a fast worker is known as fast from
its first request; workers with the same hardware on one host share a meter (`speed_class`).
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

from server.workers.hardware import Speeds
from server.workers.protocol import WorkerId, WorkerInfo


@dataclass(slots=True)
class SpeedMeter:
    """Smoothed prefill and decode throughput of one worker, tokens per second; 0 (unknown, counted as an
    average worker by the router) until `min_samples` samples, so one lucky or unlucky request cannot skew it.

    A sample must be big enough for throughput to dominate the fixed cost of a request (a round trip, a step's
    setup, attention over the cached context): a prompt found almost all in cache prefills a handful of tokens
    in a step-sized time, which would make the worker holding a conversation look several times slower than the
    others and send the conversation's next turns elsewhere (bench/routing_replay_serve.py's decision log shows
    it)."""

    alpha: float = 0.2
    min_samples: int = 3
    min_prefill_tokens: int = 256
    min_decode_tokens: int = 4
    _prefill: float = 0.0
    _decode: float = 0.0
    _prefill_samples: int = 0
    _decode_samples: int = 0

    @property
    def prefill_tok_s(self) -> float:
        return self._prefill if self._prefill_samples >= self.min_samples else 0.0

    @property
    def decode_tok_s(self) -> float:
        return self._decode if self._decode_samples >= self.min_samples else 0.0

    def add_prefill(self, tokens: int, seconds: float) -> None:
        if tokens >= self.min_prefill_tokens and seconds > 0:
            self._prefill = _smooth(self._prefill, tokens / seconds, self.alpha)
            self._prefill_samples += 1

    def add_decode(self, tokens: int, seconds: float) -> None:
        if tokens >= self.min_decode_tokens and seconds > 0:
            self._decode = _smooth(self._decode, tokens / seconds, self.alpha)
            self._decode_samples += 1

    def seed(self, speeds: Speeds | None) -> None:
        """Take a worker's calibrated speeds: the start of an unmeasured meter (counted as `min_samples` samples
        each), or one more sample of a measured one. Unmeasured (0) speeds are ignored."""
        if speeds is not None and speeds.prefill_tok_s > 0:
            self._prefill = _smooth(self._prefill, speeds.prefill_tok_s, self.alpha)
            self._prefill_samples = max(self._prefill_samples + 1, self.min_samples)
        if speeds is not None and speeds.decode_tok_s > 0:
            self._decode = _smooth(self._decode, speeds.decode_tok_s, self.alpha)
            self._decode_samples = max(self._decode_samples + 1, self.min_samples)


def speed_class(worker_id: WorkerId, info: WorkerInfo) -> Hashable:
    """Workers that share one meter: those on one host with the same hardware and threads. On a shared machine a
    wall-clock sample measures the host's load at that moment as much as the worker, and separate meters let one
    unlucky sample (a worker that calibrated while its twins were still loading) steer traffic for a whole run.
    A worker without a hardware description is a class of its own."""
    hw = info.hardware
    if hw is None:
        return worker_id
    return hw.host, hw.device.partition(":")[0], hw.device_name, hw.torch_threads


def _smooth(previous: float, sample: float, alpha: float) -> float:
    return sample if previous <= 0 else (1 - alpha) * previous + alpha * sample
