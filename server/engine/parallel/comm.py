"""The collectives of one rank of a sharded worker: gloo on the CPU, NCCL on CUDA.

Groups are built directly on a TCPStore that the driver (rank 0) hosts on a free port, never as torch's default
process group: one process may drive several sharded models, each its own group, and a group restarted
after a failure gets a new store (so nothing of the dead generation is read again). Every collective has the
group's timeout: a peer that stops answering raises here instead of hanging the step. Neither the store nor gloo
authenticates a peer, so both listen on 127.0.0.1 only (the ranks of a group are processes of one host): the store
on a socket bound here and handed to torch (which alone would listen on every interface), gloo on a device made
for 127.0.0.1 (alone, on the address the host name resolves to).

    world group    every rank: hidden states stage to stage, logits slices to the driver (point to point)
    tp group       the ranks of this rank's pipeline stage: the all-reduce of each row-parallel layer

On the CPU, with the compiled kernels, a stage's all-reduce goes through a shared-memory segment instead of gloo
(`ShmAllReduce`, kernels/shm_allreduce.cpp): one copy in, a barrier, one pass adding the ranks' parts in rank
order (the same order at every tensor size). gloo remains for what does not fit a slot and for the points to
point; NCCL does all of it on CUDA.
"""

from __future__ import annotations

import datetime
import os
import socket
import time
from pathlib import Path
from types import ModuleType

import torch
import torch.distributed as dist

from server.engine.parallel.plan import ShardPlan

HIDDEN_TAG, LOGITS_TAG = 0, 1 << 16  # point-to-point tags: + the micro-batch's index
SPINS = 4000  # pause instructions a shared-memory all-reduce's waiter spins before it sleeps (tens of microseconds)


def connect_store(port: int, plan: ShardPlan, timeout_s: float) -> dist.TCPStore:
    """A rank's client of the driver's store (the driver makes its own with `host_store`)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    return dist.TCPStore("127.0.0.1", port, plan.world_size, False, timeout=timeout)


def host_store(world_size: int, timeout_s: float) -> dist.TCPStore:
    """The driver's store, on a free loopback port (`.port`)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    return dist.TCPStore(
        "127.0.0.1", port, world_size, True, timeout=timeout, wait_for_workers=False,
        master_listen_fd=listener.detach(),  # the store owns the socket from here
    )  # fmt: skip


class ShmAllReduce:
    """A stage's all-reduce through a segment in /dev/shm that every rank of the stage maps. The driver creates
    and lays out one per stage before the ranks start (`create`), each rank maps its stage's (`open`) before it
    says Ready, and the driver unlinks them once all are Ready (the mappings stay)."""

    def __init__(self, kernels: ModuleType, path: Path, tp_rank: int, timeout_s: float) -> None:
        self.kernels = kernels
        self.rank = tp_rank
        self.timeout_s = timeout_s
        size = path.stat().st_size
        self.segment = torch.from_file(str(path), shared=True, size=size, dtype=torch.uint8)
        self.slot_floats = int(self.segment[8:16].view(torch.int64).item())
        self.calls = 0

    @staticmethod
    def create(kernels: ModuleType, path: Path, world: int, slot_floats: int, spin: bool = True) -> None:
        """Lay out a segment; `spin`: waiters spin briefly before they sleep (only where ranks have cores of
        their own)."""
        size = kernels.shm_allreduce_bytes(world, slot_floats)
        with open(os.open(path, os.O_CREAT | os.O_TRUNC | os.O_WRONLY, 0o600), "wb") as segment:
            segment.truncate(size)  # the group's ranks are this user's processes: nobody else maps it
        segment = torch.from_file(str(path), shared=True, size=size, dtype=torch.uint8)
        kernels.shm_allreduce_init(segment, world, slot_floats, SPINS if spin else 0)

    def __call__(self, partial: torch.Tensor) -> None:
        """Sum `partial` in place; RuntimeError if the group aborted or a peer did not come within the timeout."""
        done = self.kernels.shm_allreduce(partial, self.segment, self.rank, self.calls, self.timeout_s)
        self.calls += 1
        if not done:
            raise RuntimeError(
                f"shared-memory all-reduce: the group failed or a peer missed {self.timeout_s:.0f} s"
            )

    def fits(self, partial: torch.Tensor) -> bool:
        return partial.is_contiguous() and partial.numel() <= self.slot_floats

    def abort(self) -> None:
        """Any thread: every wait on the segment, this process's and the peers', fails at once."""
        self.kernels.shm_allreduce_abort(self.segment)


def segment_path(folder: str, stage: int) -> Path:
    """Where a group's all-reduce segment for `stage` lives (/dev/shm: memory, not disk)."""
    return Path("/dev/shm") / f"{folder}-stage{stage}"


class GroupComm:
    def __init__(
        self, store: dist.Store, plan: ShardPlan, device: torch.device, timeout_s: float,
        shm: ShmAllReduce | None = None,
    ) -> None:  # fmt: skip
        """Joins the groups (collective: every rank of the world, then of its stage, builds its own). `shm`: the
        stage's shared-memory all-reduce, mapped (None: gloo or NCCL for it too)."""
        self.shm = shm
        timeout = datetime.timedelta(seconds=timeout_s)
        self.world = _group(dist.PrefixStore("world", store), plan.rank, plan.world_size, device, timeout)
        if plan.pp_size == 1:
            self.tp = self.world
        elif plan.tp_size > 1:
            prefix = dist.PrefixStore(f"tp-stage{plan.stage}", store)
            self.tp = _group(prefix, plan.tp_rank, plan.tp_size, device, timeout)
        else:
            self.tp = None
        # gloo sums bf16 in bf16: partial sums of a row-parallel layer are added in fp32, as one GEMM would
        self._reduce_in_fp32 = device.type == "cpu"
        self.reduce_s = 0.0  # seconds in all_reduce (waiting for the slowest peer included), cumulative
        self.reduce_calls = 0

    def all_reduce(self, partial: torch.Tensor) -> torch.Tensor:
        """Sum `partial` over the stage's tensor-parallel ranks, in place; returns it."""
        started = time.perf_counter()
        if self.shm is not None and self.shm.fits(partial):
            self.shm(partial)
        elif self._reduce_in_fp32 and partial.dtype != torch.float32:
            total = partial.float()
            self.tp.allreduce([total]).wait()
            partial.copy_(total)
        else:
            self.tp.allreduce([partial]).wait()
        self.reduce_s += time.perf_counter() - started
        self.reduce_calls += 1
        return partial

    def send(self, tensor: torch.Tensor, dst: int, tag: int) -> dist.Work:
        """Start sending `tensor` to rank `dst`; keep `tensor` alive until the returned work is waited on."""
        return self.world.send([tensor], dst, tag)

    def recv(self, tensor: torch.Tensor, src: int, tag: int) -> None:
        """Receive into `tensor` from rank `src` (blocks, up to the group's timeout)."""
        self.world.recv([tensor], src, tag).wait()


def _group(store: dist.Store, rank: int, size: int, device: torch.device, timeout: datetime.timedelta):
    if device.type == "cuda":  # written for CUDA machines, not exercised on the CPU-only CI
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, size, options)
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    return dist.ProcessGroupGloo(store, rank, size, options)
