"""What a worker tells the router about itself when it joins: its hardware, and its speed measured at start.

The speeds seed the router's per-worker `SpeedMeter` (server/router/speed.py), so a worker on a faster machine
gets its share from its first request instead of after `min_samples` requests; traffic refines them from then on.

Calibration uses only the Engine protocol and leaves no trace in the prefix cache: every calibration sequence
stays under one KV block (prompt + output < block_size), and only full blocks are hashed, cached and announced
to the KV index. The prefill load is many such short prompts at once (~128 tokens together), which is what a
prefill step costs the model; decode speed is the per-request rate of their few decode steps.
"""

from __future__ import annotations

import fcntl
import os
import platform
import queue
import socket
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from server.engine.api import GenerationOutput, GenerationRequest, LocalEngine, RequestId, SamplingParams

CALIBRATION_PROMPT_TOKENS = 128  # prefill tokens in total (summed over the short prompts)
CALIBRATION_OUTPUT_TOKENS = 4  # per prompt: the first comes from prefill, the rest from decode steps
_CALIBRATION_TIMEOUT_S = 30.0
CALIBRATION_LOCK = (
    Path(tempfile.gettempdir()) / "strata-calibration.lock"
)  # one calibration at a time per host


@dataclass(frozen=True, slots=True)
class Speeds:
    """Measured throughput in tokens per second; 0 = not measured (the router counts it as average)."""

    prefill_tok_s: float = 0.0
    decode_tok_s: float = 0.0


@dataclass(frozen=True, slots=True)
class HardwareInfo:
    """Where a worker runs. Memory in bytes; KV capacity in blocks of the engine's pool and in bytes."""

    host: str
    device: str  # cpu | cuda | cuda:N
    device_name: str  # the GPU's name, or the CPU model for cpu
    cpu_model: str
    cpu_cores: int
    torch_threads: int
    memory_bytes: int  # host RAM
    device_memory_bytes: int  # GPU memory (0 on cpu)
    kv_capacity_blocks: int
    kv_capacity_bytes: int


def describe_hardware(engine: LocalEngine) -> HardwareInfo:
    """Read from the machine and the engine's resources (device, threads, KV pool)."""
    import torch

    resources = engine.resources
    device = resources.device
    cpu = _cpu_model()
    on_gpu = device.startswith("cuda") and torch.cuda.is_available()
    return HardwareInfo(
        host=socket.gethostname(),
        device=device,
        device_name=torch.cuda.get_device_name(torch.device(device)) if on_gpu else cpu,
        cpu_model=cpu,
        cpu_cores=os.cpu_count() or 0,
        torch_threads=resources.num_threads,
        memory_bytes=os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
        device_memory_bytes=torch.cuda.get_device_properties(torch.device(device)).total_memory
        if on_gpu
        else 0,
        kv_capacity_blocks=resources.kv_capacity_blocks,
        kv_capacity_bytes=resources.kv_capacity_bytes,
    )


def calibrate(engine: LocalEngine) -> Speeds:
    """A short prefill and a few decode steps on the real engine.

    Workers on one host calibrate one at a time (an exclusive lock on a file in the temp directory): workers that
    calibrate together measure each other's load, and the router would split work by those skewed speeds.
    Unmeasured (zeros) when the engine's blocks are too small to hold a calibration sequence in one block.
    """
    with open(CALIBRATION_LOCK, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, or when the process dies
        return _calibrate(engine)


def _calibrate(engine: LocalEngine) -> Speeds:
    layout = engine.block_layout
    prompt_len = (layout.block_size if layout is not None else 0) - 1 - CALIBRATION_OUTPUT_TOKENS
    if prompt_len < 1:
        return Speeds()
    limit = engine.resources.max_concurrent_requests
    count = max(1, min(-(-CALIBRATION_PROMPT_TOKENS // prompt_len), limit))
    outputs: queue.SimpleQueue[GenerationOutput] = queue.SimpleQueue()
    sampling = SamplingParams(max_tokens=CALIBRATION_OUTPUT_TOKENS, temperature=0.0, ignore_eos=True)
    started = time.monotonic()
    for i in range(count):
        prompt = [1 + (i * prompt_len + j) % 1000 for j in range(prompt_len)]
        engine.submit(GenerationRequest(RequestId(f"calibration-{i}"), prompt, sampling), outputs.put)
    first_at, finished = _collect(outputs, count)
    prefill_s = max(first_at.values()) - started
    decode_s = sum(finished[rid][0] - first_at[rid] for rid in finished) / count
    decoded = sum(finished[rid][1] - 1 for rid in finished) / count
    return Speeds(
        prefill_tok_s=count * prompt_len / prefill_s if prefill_s > 0 else 0.0,
        decode_tok_s=decoded / decode_s if decode_s > 0 and decoded > 0 else 0.0,
    )


def _collect(
    outputs: queue.SimpleQueue[GenerationOutput], count: int
) -> tuple[dict[str, float], dict[str, tuple[float, int]]]:
    """When each request produced its first token, and when it finished with how many output tokens."""
    first_at: dict[str, float] = {}
    finished: dict[str, tuple[float, int]] = {}
    while len(finished) < count:
        output = outputs.get(timeout=_CALIBRATION_TIMEOUT_S)
        now = time.monotonic()
        if output.finish_reason == "error":
            raise RuntimeError(f"calibration request failed: {output.error}")
        if output.new_token_ids:
            first_at.setdefault(output.request_id, now)
        if output.finished:
            first_at.setdefault(output.request_id, now)
            finished[output.request_id] = (now, output.num_output_tokens)
    return first_at, finished


def _cpu_model() -> str:
    """The CPU's marketing name from /proc/cpuinfo (Linux), else what `platform` knows."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            names = [line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")]
    except OSError:
        names = []
    return names[0] if names else platform.processor() or platform.machine()
