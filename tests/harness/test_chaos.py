"""The rules of bench/chaos.py (harness/chaos.py): victim choice, outage spans, RSS growth, the malformed requests."""

from __future__ import annotations

import json
import random

from harness.chaos import REMOTE_ID, Liveness, malformed_requests, pick_victim, rss_growth


def test_pick_victim_spares_the_last_worker_and_the_last_local_one() -> None:
    rng = random.Random(0)
    assert pick_victim({"w0"}, kill_last=False, rng=rng) is None
    assert pick_victim({REMOTE_ID}, kill_last=False, rng=rng) is None
    # locals are not restarted: with one left, only the remote worker may go
    assert {pick_victim({"w0", REMOTE_ID}, False, rng) for _ in range(20)} == {REMOTE_ID}
    assert {pick_victim({"w0", "w1"}, False, rng) for _ in range(50)} == {"w0", "w1"}
    assert pick_victim({"w0"}, kill_last=True, rng=rng) == "w0"
    assert pick_victim(set(), kill_last=True, rng=rng) is None


def test_liveness_records_spans_with_no_worker() -> None:
    liveness = Liveness({"w0", REMOTE_ID}, now=0.0)
    liveness.leave("w0", 1.0)
    assert liveness.outages == [] and liveness.alive() == {REMOTE_ID}
    liveness.leave(REMOTE_ID, 2.0)
    assert liveness.overlaps_outage(2.5, 3.0)  # open span
    liveness.join(REMOTE_ID, 5.0)
    assert liveness.outages == [[2.0, 5.0]]
    assert liveness.overlaps_outage(0.0, 2.0) and liveness.overlaps_outage(4.0, 9.0)
    assert not liveness.overlaps_outage(0.0, 1.9) and not liveness.overlaps_outage(5.1, 9.0)


def test_rss_growth_compares_only_processes_alive_at_both_samples() -> None:
    def sample(**roles: tuple[list[int], float]) -> dict:
        return {"processes": {r: {"pids": p, "rss_mib": m, "fds": 3} for r, (p, m) in roles.items()}}

    baseline = sample(serve=([1], 100.0), w0=([2], 200.0), remote=([3], 50.0))
    end = sample(serve=([1], 104.0), remote=([9], 60.0))  # w0 killed, remote restarted
    assert rss_growth(baseline, end) == {"serve": 0.04}


def test_malformed_requests_are_what_they_say() -> None:
    requests = {kind: (path, body) for kind, path, body in malformed_requests(oversized_mb=1)}
    for kind in ("bad JSON", "temperature Infinity"):
        try:
            json.loads(requests[kind][1], parse_constant=lambda c: (_ for _ in ()).throw(ValueError(c)))
        except ValueError:
            continue
        raise AssertionError(f"{kind} parsed as strict JSON")
    assert json.loads(requests["top_p 1.5"][1])["top_p"] == 1.5
    assert requests["messages a string"][0] == "/v1/chat/completions"
    assert len(requests["body of 1 MiB"][1]) >= 2**20
