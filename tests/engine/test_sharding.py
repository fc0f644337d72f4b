"""Sharded engines (server/engine/parallel): tensor parallel over 3 ranks and pipeline parallel over 2 stages give
SmolLM2's greedy answers token for token as one process does (fp32: a different summation order of the split
layers could flip a near tie; none does on these prompts), chunked prefill and concurrent requests included; a
size that does not divide the model is refused by name; ranks are named processes; a rank killed with SIGKILL
mid-stream costs no request (the group restarts and the requests are recomputed); a sharded engine onboards its
parts of a prefix from G2, and an unsharded one never reads those parts as its own. Real model, real processes,
gloo on the CPU."""

from __future__ import annotations

import os
import signal
import socket
import threading
import uuid
from pathlib import Path

import msgspec
import pytest
import torch

from harness.waiting import wait_for
from kvbm.config import KVBMConfig
from kvbm.connector import KVBMConnector
from kvbm.host_pool import remove_segments
from kvbm.transfer_params import KVHandoff, RemoteDecode, decode_transfer_params, encode_transfer_params
from server.engine.api import GenerationOutput, GenerationRequest, RequestId, SamplingParams
from server.engine.config import EngineConfig
from server.engine.llm_engine import LLMEngine
from server.engine.parallel.comm import host_store
from server.engine.parallel.executor import _join, _micro_batches
from server.engine.parallel.plan import ShardPlan, stage_layers, vocab_slice
from server.engine.scheduler import ScheduledChunk
from server.engine.stream import generate

pytestmark = pytest.mark.slow
MODEL_CACHE = Path(__file__).resolve().parents[2] / ".strata-cache" / "models"
TOKENS = 12
LONG = "The lighthouse keeper wrote in his log every night about the ships, the weather and the sea. " * 12
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time",
    LONG + "The keeper's log said",
]


def engine(tp: int = 1, pp: int = 1, connector=None, num_kv_blocks: int = 256) -> LLMEngine:
    config = EngineConfig(
        cache_dir=str(MODEL_CACHE), dtype="float32", device="cpu", num_kv_blocks=num_kv_blocks, max_model_len=1024,
        max_num_batched_tokens=64, max_tokens_limit=64, tensor_parallel_size=tp, pipeline_parallel_size=pp,
    )  # fmt: skip
    return LLMEngine(config, connector)


def together(e: LLMEngine, prompts: list[str], tag: str) -> list[list[int]]:
    """The greedy answers of `prompts` submitted at once (batched and, for the long one, chunked)."""
    results: list[GenerationOutput | None] = [None] * len(prompts)

    def run(i: int) -> None:
        request = GenerationRequest(
            RequestId(f"{tag}-{i}"), e.encode(prompts[i]), SamplingParams(max_tokens=TOKENS, temperature=0)
        )
        results[i] = generate(e, request, timeout=600)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert all(r is not None and r.error is None for r in results), results
    return [r.new_token_ids for r in results]


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    with engine() as one:
        return together(one, PROMPTS, "ref")


@pytest.fixture(scope="module")
def tp3():
    with engine(tp=3) as sharded:
        yield sharded


def test_tensor_parallel_3_answers_as_one_process(tp3, reference):
    assert len(tp3.encode(PROMPTS[-1])) > 3 * 64  # prefilled in chunks
    assert together(tp3, PROMPTS, "tp3") == reference
    ranks = tp3.stats().ranks
    assert [r.rank for r in ranks] == [0, 1, 2] and all(r.up and r.rss_bytes > 0 for r in ranks)
    assert len({r.pid for r in ranks}) == 3


def test_pipeline_parallel_2_answers_as_one_process_and_both_stages_compute(reference):
    with engine(pp=2) as pp2:
        assert together(pp2, PROMPTS, "pp2") == reference
        busy = [r.busy_s for r in pp2.stats().ranks]
    assert len(busy) == 2 and all(b > 0 for b in busy)


def test_ranks_are_named_processes(tp3):
    for rank in tp3.stats().ranks[1:]:
        title = Path(f"/proc/{rank.pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
        assert title == f"strata {tp3.model_name} worker 0 rank {rank.rank}/3"


def listening(pid: int) -> set[tuple[str, int]]:
    """(address, port) of every TCP socket process `pid` listens on (/proc: its socket inodes in the tables)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        target = os.readlink(fd) if fd.is_symlink() else ""
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = set()
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/{pid}/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # LISTEN
                address, port = fields[1].split(":")
                found.add((address, int(port, 16)))
    return found


LOOPBACK = "0100007F"  # 127.0.0.1 as /proc/net/tcp writes it


def test_the_unauthenticated_group_links_listen_on_loopback_only(tp3):
    """The store (the driver's) and gloo (every rank's) authenticate no peer: nothing of theirs may be reachable
    from another host."""
    store = host_store(1, 5.0)
    assert listening(os.getpid()) >= {(LOOPBACK, store.port)}
    del store
    for rank in tp3.stats().ranks[1:]:
        addresses = listening(rank.pid)
        assert addresses and {address for address, _ in addresses} == {LOOPBACK}, addresses


def test_a_size_that_does_not_divide_the_model_is_refused_by_name():
    with pytest.raises(ValueError, match=r"tensor_parallel_size 2 does not divide the model's "
                       r"num_attention_heads \(9\)"):  # fmt: skip
        engine(tp=2)
    with pytest.raises(
        ValueError, match=r"pipeline_parallel_size 31 is more than the model's num_hidden_layers"
    ):
        engine(pp=31)


def test_a_rank_killed_mid_stream_costs_no_request(tp3, reference):
    """SIGKILL rank 2 while three requests stream: the group is killed and restarted (new rank processes), the
    requests are recomputed on it and end with the answers they would have had."""
    old = {r.rank: r.pid for r in tp3.stats().ranks}
    outputs: dict[int, list[int]] = {i: [] for i in range(3)}
    finished = [threading.Event() for _ in range(3)]
    errors: list[str] = []

    def sink(i: int):
        def receive(output: GenerationOutput) -> None:
            outputs[i].extend(output.new_token_ids)
            if output.error:
                errors.append(output.error)
            if output.finished:
                finished[i].set()

        return receive

    for i in range(3):
        params = SamplingParams(max_tokens=TOKENS, temperature=0)
        tp3.submit(GenerationRequest(RequestId(f"kill-{i}"), tp3.encode(PROMPTS[i]), params), sink(i))
    wait_for(lambda: sum(map(len, outputs.values())) >= 3, 120, what="the requests streaming")
    os.kill(old[2], signal.SIGKILL)
    assert all(event.wait(600) for event in finished)
    assert not errors
    assert [outputs[i] for i in range(3)] == reference[:3]
    stats = tp3.stats()
    assert stats.restarts == {"SIGKILL": 1}
    wait_for(lambda: all(r.up for r in tp3.stats().ranks), 60, what="every rank up again")
    new = {r.rank: r.pid for r in tp3.stats().ranks}
    assert new[0] == old[0] and new[1] != old[1] and new[2] != old[2]
    assert together(tp3, PROMPTS[:2], "after") == reference[:2]


def test_a_sharded_engine_onboards_its_parts_from_g2_and_an_unsharded_one_does_not_read_them(reference):
    """A G1 pool of 24 blocks: the long prompt (15 blocks) is evicted by another one, every rank offloading its
    part of each block to its G2 segment; asked again, every full block comes back from there."""
    cache_id = f"test-{uuid.uuid4().hex[:12]}"
    kvbm = KVBMConfig(cache_id=cache_id, host_cache_gb=0.25, keep_host_cache=True)

    def ask(e: LLMEngine, tag: str, prompt: list[int]) -> GenerationOutput:
        request = GenerationRequest(RequestId(tag), prompt, SamplingParams(max_tokens=TOKENS, temperature=0))
        return generate(e, request, timeout=600)

    try:
        with engine(tp=3, connector=KVBMConnector(kvbm, "w-a"), num_kv_blocks=24) as sharded:
            ids = sharded.encode(PROMPTS[-1])
            assert ask(sharded, "g2-first", ids).new_token_ids == reference[-1]
            ask(sharded, "g2-evict", sharded.encode(LONG.replace("lighthouse", "harbour") + "The harbour"))
            again = ask(sharded, "g2-again", ids)
        assert again.new_token_ids == reference[-1]
        assert again.num_cached_tokens == (len(ids) - 1) // 16 * 16  # every full block but the last token's
        with engine(connector=KVBMConnector(kvbm, "w-c")) as unsharded:  # the same G2, whole blocks
            other = ask(unsharded, "g2-tp1", ids)
        assert other.num_cached_tokens == 0 and other.new_token_ids == reference[-1]
    finally:
        remove_segments(cache_id)


def test_sharded_prefill_and_decode_engines_hand_the_prompt_over_through_their_ranks_tiers(reference):
    """Disaggregated and sharded alike (TP 3 both): the prefill engine's ranks offload their parts of the prompt's
    blocks to G2 after its first token (no direct handoff for parts); the decode engine's ranks read theirs back
    at admission and it decodes on, giving what one engine gives."""
    cache_id = f"test-{uuid.uuid4().hex[:12]}"
    kvbm = KVBMConfig(cache_id=cache_id, host_cache_gb=0.25)
    request = GenerationRequest(RequestId("disagg"), [], SamplingParams(max_tokens=TOKENS, temperature=0))
    decoder = KVBMConnector(kvbm, "w-d")
    try:
        with (
            engine(tp=3, connector=KVBMConnector(kvbm, "w-p")) as prefill,
            engine(tp=3, connector=decoder) as decode,
        ):
            request = msgspec.structs.replace(request, prompt_token_ids=prefill.encode(PROMPTS[-1]))
            params = encode_transfer_params(RemoteDecode(socket.gethostname()))
            first = generate(
                prefill, msgspec.structs.replace(request, kv_transfer_params=params), timeout=600
            )
            handoff = decode_transfer_params(first.kv_transfer_params)
            assert isinstance(handoff, KVHandoff) and handoff.transport == "kvbm"
            resumed = msgspec.structs.replace(
                request,
                request_id=RequestId("disagg-decode"),
                kv_transfer_params=encode_transfer_params(handoff),
            )
            rest = generate(decode, resumed, timeout=600)
        assert first.new_token_ids + rest.new_token_ids == reference[-1]
        onboarded = decoder.metrics.registry.get_sample_value(
            "kvbm_onboard_blocks_total", {"model": decoder.metrics.model, "direction": "G2->G1"}
        )
        assert onboarded == len(request.prompt_token_ids) // 16  # every full block of the prompt
    finally:
        remove_segments(cache_id)


def test_plans_split_layers_heads_and_vocabulary():
    assert [stage_layers(30, 2, s) for s in range(2)] == [range(0, 15), range(15, 30)]
    assert [stage_layers(7, 3, s) for s in range(3)] == [range(0, 3), range(3, 5), range(5, 7)]
    assert [len(vocab_slice(49152, 3, r)) for r in range(3)] == [16384] * 3
    plan = ShardPlan(tp_size=3, pp_size=2, rank=4, num_layers=30)
    assert (plan.stage, plan.tp_rank, plan.layers, plan.peer(0)) == (1, 1, range(15, 30), 1)
    assert plan.tag == "|tp3r1|pp2s1"


class _Seq:
    def __init__(self, num_tokens: int, computed: int) -> None:
        self.num_tokens, self.num_computed_tokens = num_tokens, computed


def test_micro_batches_balance_tokens_and_logits_come_back_in_the_cores_order():
    chunks = [
        ScheduledChunk(_Seq(100, 0), 100),
        ScheduledChunk(_Seq(51, 50), 1),
        ScheduledChunk(_Seq(80, 0), 64),
    ]
    groups = _micro_batches(chunks, 2)
    assert [[c.num_tokens for c in g] for g in groups] == [[100], [1, 64]]
    assert _micro_batches(chunks, 1) == [chunks]
    # each micro-batch: its sampling rows, then its prompt-logprob rows; the core wants all sampling rows first
    logits = [torch.tensor([[1.0], [10.0]]), torch.tensor([[2.0], [20.0]])]  # rows: sampling 1, prompt 1 each
    mb = [[ScheduledChunk(_Seq(10, 0), 10)], [ScheduledChunk(_Seq(5, 4), 1)]]
    assert _join(mb, logits).flatten().tolist() == [1.0, 2.0, 10.0, 20.0]
