"""The conditional-disaggregation rule (server/router/disagg.py), table-driven, and its thresholds changed live."""

from __future__ import annotations

import pytest

from server.router.disagg import DisaggConfig, DisaggRule

CASES = [  # uncached tokens, remote prefills in flight, live prefill workers -> (remote, reason)
    (2000, 0, 1, (True, "long_prompt")),
    (513, 3, 2, (True, "long_prompt")),
    (512, 0, 1, (False, "short_prompt")),  # at the threshold: local
    (0, 0, 1, (False, "short_prompt")),  # all cached on the decode worker
    (2000, 4, 1, (False, "queue_full")),
    (2000, 9, 3, (False, "queue_full")),
    (2000, 0, 0, (False, "no_prefill_worker")),  # checked first: no worker, no remote
    (10, 9, 0, (False, "no_prefill_worker")),
]


@pytest.mark.parametrize(("uncached", "queued", "workers", "expected"), CASES)
def test_rule(uncached: int, queued: int, workers: int, expected: tuple[bool, str]) -> None:
    rule = DisaggRule(DisaggConfig(max_local_prefill_length=512, max_prefill_queue_size=4))
    assert rule.decide(uncached, queued, workers) == expected


def test_thresholds_change_while_serving_and_bad_ones_change_nothing() -> None:
    rule = DisaggRule()
    assert rule.thresholds() == {"max_local_prefill_length": 512, "max_prefill_queue_size": 4}
    rule.set(max_local_prefill_length=100)
    assert rule.decide(101, 0, 1) == (True, "long_prompt")
    rule.set(max_prefill_queue_size=0)  # 0: never remote
    assert rule.decide(5000, 0, 1) == (False, "queue_full")
    with pytest.raises(ValueError, match="max_local_prefill_length"):
        rule.set(max_local_prefill_length=-1)
    assert rule.thresholds() == {"max_local_prefill_length": 100, "max_prefill_queue_size": 0}
