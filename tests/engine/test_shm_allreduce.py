"""The shared-memory all-reduce of a sharded worker's tensor-parallel ranks (kernels/shm_allreduce.cpp), with real
processes: sums in rank order whatever the tensor's size (fp32 bit for bit against (a + b) + c), bf16 summed in
fp32 and rounded once, many calls in a row on the two alternating halves, and a wait that ends at once when the
group aborts, or at its timeout when a peer never comes."""

from __future__ import annotations

import multiprocessing
import time
import uuid

import pytest
import torch

from server.engine.kernels import cpu_kernels
from server.engine.parallel.comm import ShmAllReduce, segment_path

WORLD = 3
SLOT = 1 << 16

# the all-reduce is plain C++ (no instruction set of its own): a machine where it did not build fails here, never
# skips (sharded engines would fall back to gloo without a word)
pytestmark = pytest.mark.usefixtures("kernels")


def parts(rows: int, call: int, dtype: torch.dtype) -> list[torch.Tensor]:
    """What each rank sums at `call`: values of very different magnitudes, so the order of the sum shows."""
    generator = torch.Generator().manual_seed(call)
    return [
        (torch.randn(rows, 512, generator=generator) * 10.0 ** (rank * 3 - 3)).to(dtype)
        for rank in range(WORLD)
    ]


def _rank(path: str, rank: int, calls: list[tuple[int, str]], results) -> None:
    torch.set_num_threads(1)
    shm = ShmAllReduce(cpu_kernels(), segment_path(path, 0), rank, timeout_s=30)
    out = []
    for call, (rows, dtype) in enumerate(calls):
        tensor = parts(rows, call, getattr(torch, dtype))[rank].clone()
        shm(tensor)
        out.append(
            tensor.float().numpy().tobytes()
        )  # bytes: a tensor would travel as a handle to this process
    results.put((rank, out))


@pytest.fixture
def segment():
    name = f"strata-test-{uuid.uuid4().hex[:8]}"
    ShmAllReduce.create(cpu_kernels(), segment_path(name, 0), WORLD, SLOT)
    yield name
    segment_path(name, 0).unlink(missing_ok=True)


def test_sums_in_rank_order_at_every_size_and_dtype(segment):
    calls = [
        (1, "float32"),
        (7, "float32"),
        (100, "float32"),
        (1, "bfloat16"),
        (64, "bfloat16"),
        (3, "float32"),
    ]
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    ranks = [context.Process(target=_rank, args=(segment, r, calls, results)) for r in range(WORLD)]
    for process in ranks:
        process.start()
    got = dict(results.get(timeout=120) for _ in range(WORLD))
    for process in ranks:
        process.join(30)
    for call, (rows, dtype) in enumerate(calls):
        a, b, c = (part.float() for part in parts(rows, call, getattr(torch, dtype)))
        expected = ((a + b) + c).to(getattr(torch, dtype))  # rank order, fp32, rounded once
        for rank in range(WORLD):
            assert got[rank][call] == expected.float().numpy().tobytes(), (call, rank)


def test_a_wait_ends_at_once_on_abort_and_at_its_timeout_without_a_peer(segment):
    lonely = ShmAllReduce(cpu_kernels(), segment_path(segment, 0), 0, timeout_s=0.5)
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="the group failed or a peer missed"):
        lonely(torch.ones(4, 8))  # ranks 1 and 2 never come
    # the timeout is the contract: not before it (a load can only lengthen the wait), and well within ten times it
    assert 0.5 <= time.monotonic() - started < 10 * 0.5

    waiting = ShmAllReduce(cpu_kernels(), segment_path(segment, 0), 1, timeout_s=60)
    context = multiprocessing.get_context("spawn")
    aborter = context.Process(target=_abort_once_arrived, args=(segment, arrived(waiting.segment)))
    aborter.start()
    started = time.monotonic()
    with pytest.raises(RuntimeError):
        waiting(torch.ones(4, 8))  # the aborter aborts once this rank is counted at the barrier
    assert time.monotonic() - started < 60 / 2  # woken by the abort, not by its 60-s timeout
    aborter.join(30)
    assert aborter.exitcode == 0


def arrived(segment: torch.Tensor) -> int:
    """The segment's count of ranks arrived at the current barrier (offset 64, see shm_allreduce.cpp)."""
    return int(segment[64:68].view(torch.int32).item())


def _abort_once_arrived(name: str, before: int) -> None:
    """Abort the group once one more rank arrived at its barrier: the abort always finds a rank waiting. Polls the
    shared count (another process's futex word has nothing to block on here)."""
    shm = ShmAllReduce(cpu_kernels(), segment_path(name, 0), 2, timeout_s=1)
    deadline = time.monotonic() + 30
    while arrived(shm.segment) == before:
        assert time.monotonic() < deadline, "the waiting rank never arrived"
        time.sleep(0.001)  # polls shared memory: nothing to block on from this process
    shm.abort()
