"""The router's one config object; `strata serve` maps its flags (--routing-strategy, --router-fallback, ...) here."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Strategy = Literal["kv-aware", "round-robin", "random", "least-loaded"]
STRATEGIES: tuple[Strategy, ...] = ("kv-aware", "round-robin", "random", "least-loaded")


@dataclass(slots=True)
class RouterConfig:
    """Knobs of the cost function `overlap_weight * blocks_to_prefill + active_blocks` (all in blocks).

    A block found in G2/G3/G4/G5 costs `onboard_cost_g2/g3/g4/g5` of a prefill (loading a block is much cheaper than
    recomputing it, and each tier below is slower than the one above). A worker whose last report shows
    `busy_threshold` of its KV capacity or more in use is skipped unless every worker is (queued requests hold no
    KV yet: they count in the cost, as pending prefill). A lookup slower than `lookup_budget_s` or failing makes
    this decision and those of the next `lookup_cooldown_s` use `fallback`. With no index event for
    `stale_after_s` while requests with full blocks keep coming, the index is declared stale (logged once).
    With `count_in_flight`, the blocks of requests routed to a worker and not yet finished count as held there
    in G1 (the index learns of them only once prefilled), so a conversation's next turn or a parallel request
    with the same prompt follows its prefix even while that prefix is still being computed.
    """

    strategy: Strategy = "kv-aware"
    fallback: Strategy = "least-loaded"
    overlap_weight: float = 1.0
    temperature: float = 0.0
    onboard_cost_g2: float = 0.05
    onboard_cost_g3: float = 0.1
    onboard_cost_g4: float = 0.2
    onboard_cost_g5: float = 0.3
    busy_threshold: float = 0.95
    lookup_budget_s: float = 0.005
    lookup_cooldown_s: float = 1.0
    stale_after_s: float = 30.0
    count_in_flight: bool = (
        False  # off: no gain measured on bench/routing_replay_serve.py (see docs/routing.md)
    )
    migration_limit: int = 3  # times one request may be resumed on another worker after its worker died
    seed: int | None = None

    def __post_init__(self) -> None:
        for name in ("strategy", "fallback"):
            if getattr(self, name) not in STRATEGIES:
                raise ValueError(
                    f"router {name}: {getattr(self, name)!r} is not one of {', '.join(STRATEGIES)}"
                )
        if self.fallback == "kv-aware":
            raise ValueError("router fallback: must not be kv-aware (it is used when the KV index fails)")
        for name in (
            "overlap_weight",
            "temperature",
            "onboard_cost_g2",
            "onboard_cost_g3",
            "onboard_cost_g4",
            "onboard_cost_g5",
            "lookup_budget_s",
            "lookup_cooldown_s",
            "stale_after_s",
        ):
            if getattr(self, name) < 0:
                raise ValueError(f"router {name}: must be >= 0, got {getattr(self, name)}")
        if self.migration_limit < 0:
            raise ValueError(f"router migration_limit: must be >= 0, got {self.migration_limit}")
        if not 0 < self.busy_threshold <= 1:
            raise ValueError(f"router busy_threshold: must be in (0, 1], got {self.busy_threshold}")
