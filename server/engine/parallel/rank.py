"""A rank of a sharded worker (every rank but the driver): `python -m server.engine.parallel.rank`, its `RankSpec`
as one JSON line on stdin.

Its life: title itself, beat to the driver from a thread of its own, load its part of the model and its KV pool
rows, say Ready, join the group's collectives, then apply the driver's messages in order (steps, KV lookups,
onboards and offloads on its own tiers) until Stop. It exits when its stdin reaches EOF (the driver is gone) or
anything fails: the driver sees the exit and restarts the whole group, so a rank never tries to recover alone.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from pathlib import Path

import msgspec
import setproctitle
import zmq

from server import tracing
from server.engine.parallel import wire
from server.engine.parallel.group import RankSpec, resident_bytes

log = logging.getLogger("strata.rank")


def main() -> None:
    spec = RankSpec.decode(sys.stdin.buffer.readline())
    setproctitle.setproctitle(spec.title)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {spec.title} %(levelname)s %(message)s")
    tracing.configure_from(spec.tracing, f"{spec.worker_id} rank {spec.rank}")
    threading.Thread(target=_exit_with_driver, name="driver-watch", daemon=True).start()
    context = zmq.Context()
    replies = context.socket(zmq.PUSH)
    replies.setsockopt(zmq.LINGER, 1000)
    replies.connect(spec.replies)
    lock = threading.Lock()  # the PUSH socket is shared by the beat thread and the main one

    def reply(message: wire.FromRank) -> None:
        with lock:
            replies.send(msgspec.msgpack.encode(message))

    work = Work()
    threading.Thread(target=_beat, args=(spec, reply, work), name="beat", daemon=True).start()
    control = context.socket(zmq.PULL)
    control.connect(spec.control)
    try:
        served = _serve(spec, control, reply, work)
    except Exception:
        log.exception("rank %d failed", spec.rank)
        os._exit(1)
    os._exit(0 if served else 1)


class Work:
    """Seconds this rank has spent computing steps (read by the beat thread)."""

    busy_s = 0.0


def _serve(spec: RankSpec, control: zmq.Socket, reply, work: Work) -> bool:
    """Load, join, then apply messages until Stop. False if loading failed (reported as LoadFailed)."""
    import torch

    from server.engine.parallel.comm import GroupComm, connect_store
    from server.engine.parallel.stage import StageRunner

    torch.set_num_threads(spec.num_threads)
    plan = spec.plan
    try:
        runner, connector, shm = _load(spec)
    except Exception as err:
        log.exception("loading rank %d failed", spec.rank)
        reply(wire.LoadFailed(spec.rank, f"{type(err).__name__}: {err}"[:1000]))
        return False
    reply(wire.Ready(spec.rank, os.getpid()))
    store = connect_store(spec.store_port, plan, spec.collective_timeout_s)
    comm = GroupComm(store, plan, runner.device, spec.collective_timeout_s, shm)
    runner.model.join_group(comm.all_reduce)
    stage = StageRunner(runner.model, runner.kv_cache, comm, plan)
    decoder = msgspec.msgpack.Decoder(wire.ToRank)
    with torch.inference_mode():
        while True:
            message = decoder.decode(control.recv())
            if isinstance(message, wire.Step):
                started = time.time_ns() if message.traces else 0
                stage.run([wire.decode_batch(batch, runner.device) for batch in message.batches])
                work.busy_s = stage.busy_s
                for traceparent, tokens in message.traces:
                    attributes = {"strata.rank": spec.rank, "strata.prefill.tokens": tokens}
                    tracing.record_span("strata.rank.step", traceparent, started, time.time_ns(), attributes)
            elif isinstance(message, wire.Offload):
                if connector is not None:
                    connector.offload(message.block_hashes, message.block_ids)
                reply(wire.Answer(message.call_id, spec.rank, 0))
            elif isinstance(message, wire.Lookup):
                held = connector.lookup(message.block_hashes) if connector is not None else 0
                reply(wire.Answer(message.call_id, spec.rank, held))
            elif isinstance(message, wire.Onboard):
                valid = (
                    connector.onboard(message.block_hashes, message.block_ids) if connector is not None else 0
                )
                reply(wire.Answer(message.call_id, spec.rank, valid))
            else:  # Stop
                if connector is not None:
                    connector.close()
                tracing.shutdown()  # export what is buffered: the process ends with os._exit
                return True


def _load(spec: RankSpec):
    """This rank's model part, pool and tiers, and its stage's all-reduce segment mapped (None: gloo's)."""
    from kvbm.connector import KVBMConnector
    from server.engine import kernels
    from server.engine.builder import kv_layout, load_model
    from server.engine.loader import load_config, prepare_model
    from server.engine.model import ModelShape
    from server.engine.model_runner import ModelRunner
    from server.engine.parallel.comm import ShmAllReduce

    config = spec.engine
    files = prepare_model(config.model, Path(config.cache_dir).expanduser() if config.cache_dir else None)
    shape = ModelShape.from_config(load_config(files))
    plan = spec.plan
    runner = ModelRunner(load_model(config, files, shape, plan), spec.num_blocks, config.block_size)
    connector = None
    if spec.kvbm is not None:  # its part of every block; the driver's connector tells the index
        connector = KVBMConnector(spec.kvbm, spec.worker_id, events=None, model=config.model_name or "")
        connector.bind(runner.kv_cache, kv_layout(files, config, shape, plan))
    shm = None
    if spec.reduce_segment:  # mapped before Ready: the driver unlinks it once every rank is
        compiled = kernels.cpu_kernels()
        if compiled is None:
            raise RuntimeError(
                "the driver all-reduces through shared memory, but this rank has no compiled kernels"
            )
        shm = ShmAllReduce(compiled, Path(spec.reduce_segment), plan.tp_rank, spec.collective_timeout_s)
    return runner, connector, shm


def _beat(spec: RankSpec, reply, work: Work) -> None:
    while True:
        reply(wire.Beat(spec.rank, resident_bytes(), work.busy_s))
        time.sleep(spec.heartbeat_s)


def _exit_with_driver() -> None:
    """The driver holds the other end of stdin: EOF means it is gone (even killed with SIGKILL)."""
    while sys.stdin.buffer.read(4096):
        pass
    log.warning("the driver is gone; rank exiting")
    os._exit(1)


if __name__ == "__main__":
    main()
