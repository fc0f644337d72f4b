"""Reading one series off a /metrics page, labels and all."""

from __future__ import annotations

from harness.metrics import samples

PAGE = """# HELP strata_router_decisions_total Routing decisions
# TYPE strata_router_decisions_total counter
strata_router_decisions_total{reason="prefix_hit",strategy="kv-aware"} 3.0
strata_router_decisions_total{reason="load",strategy="kv-aware"} 2.0
strata_router_decisions_created{reason="load",strategy="kv-aware"} 1.7e+09
# HELP strata_worker_info Worker hardware
# TYPE strata_worker_info gauge
strata_worker_info{worker="w0",cpu="x86"} 1.0
"""


def test_samples_of_one_series_with_their_labels() -> None:
    assert samples(PAGE, "strata_router_decisions_total") == [
        ({"reason": "prefix_hit", "strategy": "kv-aware"}, 3.0),
        ({"reason": "load", "strategy": "kv-aware"}, 2.0),
    ]
    assert samples(PAGE, "strata_worker_info") == [({"worker": "w0", "cpu": "x86"}, 1.0)]
    assert samples(PAGE, "strata_router_migrations_total") == []
