"""bf16 greedy output against transformers in bf16 on the same weights, and both against the fp32 reference.

bf16 sums in another order (fused q/k/v, fp32 norms, decode attention in fp32 from the pool, and on an AVX512-BF16
or AMX CPU prefill attention by the compiled kernel: bf16 products, fp32 softmax; bf16 SDPA in transformers) cannot be
token-identical, so the check is statistical and says where each prompt diverges: concurrent (batched, chunked
prefill of the long prompts), then again with the prompts' blocks cached.

A greedy divergence cascades (every token after it differs), so a share of identical tokens over 22 prompts moves by
several points with the batch's composition or the CPU. What does not move is why a prompt diverges: as in vLLM's
`check_logprobs_close`, every first divergence from the fp32 reference must be a near-tie in fp32's own logits at
that point (our token in fp32's top 5, within `NEAR_TIE_LOGITS` of its best). A wrong block, mask or position
gives a token far down that list; bf16 rounding gives the runner-up.
"""

from __future__ import annotations

import pytest
import torch
from conftest import PROMPTS, collect_concurrently, engine_config, greedy, hf_greedy

from server.engine.llm_engine import LLMEngine

TOP_K = 5
# measured on an AVX512-BF16 host, 36 divergences: the largest fp32 gap 0.33 logits, ranks 1 to 3
NEAR_TIE_LOGITS = 1.0


@pytest.fixture(scope="module")
def bf16_engine():
    with LLMEngine(engine_config(dtype="bfloat16", max_num_batched_tokens=256)) as engine:
        yield engine


@pytest.fixture(scope="module")
def hf_bf16_outputs(bf16_engine, prompt_ids):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(bf16_engine.files.folder, dtype=torch.bfloat16).eval()
    return hf_greedy(model, prompt_ids)


def first_divergence(ours: list[int], theirs: list[int]) -> int | None:
    first = next((i for i, (x, y) in enumerate(zip(ours, theirs, strict=False)) if x != y), None)
    if first is None and len(ours) != len(theirs):
        first = min(len(ours), len(theirs))
    return first


def agreement(ours: list[list[int]], theirs: list[list[int]]) -> tuple[float, list[int | None]]:
    """(share of tokens before each prompt's first divergence, first divergence per prompt or None)."""
    same = total = 0
    firsts = [first_divergence(a, b) for a, b in zip(ours, theirs, strict=True)]
    for a, b, first in zip(ours, theirs, firsts, strict=True):
        same += len(a) if first is None else first
        total += max(len(a), len(b))
    return same / total, firsts


def divergences_from_fp32(hf_model, prompt_ids, outputs, reference) -> list[tuple[int, int, int, float]]:
    """(prompt, position, rank of the token in fp32's logits, fp32 logit gap to its best) per diverging prompt.

    A prompt whose output only stops earlier or later (EOS) has no differing token and is left out.
    """
    found = []
    for index, (ours, theirs) in enumerate(zip(outputs, reference, strict=True)):
        first = first_divergence(ours, theirs)
        if first is None or first >= min(len(ours), len(theirs)):
            continue
        with torch.inference_mode():
            logits = hf_model(torch.tensor([prompt_ids[index] + ours[:first]])).logits[0, -1].float()
        token = ours[first]
        rank = int((logits > logits[token]).sum())
        found.append((index, first, rank, round(float(logits.max() - logits[token]), 3)))
    return found


def test_bf16_tracks_transformers_bf16_and_every_departure_from_fp32_is_a_near_tie(
    bf16_engine, hf_model, prompt_ids, hf_bf16_outputs, reference_outputs
):
    theirs_from_fp32 = divergences_from_fp32(hf_model, prompt_ids, hf_bf16_outputs, reference_outputs)
    theirs_fp32_share, _ = agreement(hf_bf16_outputs, reference_outputs)
    for attempt in ("fresh", "cached"):
        tokens = collect_concurrently(
            bf16_engine, [greedy(ids, f"{attempt}-{i}") for i, ids in enumerate(prompt_ids)]
        )
        ours = [tokens[f"{attempt}-{i}"] for i in range(len(prompt_ids))]
        share, firsts = agreement(ours, hf_bf16_outputs)
        ours_from_fp32 = divergences_from_fp32(hf_model, prompt_ids, ours, reference_outputs)
        fp32_share, _ = agreement(ours, reference_outputs)
        report = (
            f"{attempt}: {share:.1%} of tokens identical to transformers bf16, "
            f"{fp32_share:.1%} to fp32 (transformers bf16: {theirs_fp32_share:.1%}), "
            f"{sum(f is None for f in firsts)}/{len(firsts)} prompts fully; first divergence per prompt {firsts}; "
            f"departures from fp32 (prompt, token, fp32 rank, logit gap): ours {ours_from_fp32}, "
            f"transformers bf16 {theirs_from_fp32}"
        )
        print(report)
        assert len(PROMPTS) == len(firsts)
        # measured: 84.9-89.0 % identical, 15-17/22 prompts fully with SDPA prefill (AVX2 and AVX512-BF16
        # hosts), 86 % with the AMX kernel; 71.3 %, 12/22, with the AVX512-BF16 kernel, whose outputs were as close
        # to fp32's as SDPA's (77.0 % identical to fp32 either way): a cascade after a near-tie moves this share
        # by 15 points, a wrong mask or block takes it near 0
        assert share >= 0.65, report
        # a bound measured in this run, not on a quiet machine: ours is about as close to fp32 as transformers
        # bf16 is, less one cascade (measured 2026-12-07, AMD EPYC, AVX512-BF16 kernel: 76.7 % against 83.4 %)
        assert fp32_share >= theirs_fp32_share - 0.15, report
        assert sum(f is None for f in firsts) >= len(firsts) // 2, report
        for _, _, rank, gap in ours_from_fp32:
            assert rank < TOP_K and gap <= NEAR_TIE_LOGITS, report
