"""Next-token choice for a batch of sequences, vectorized over rows.

Order: logprobs of the raw logits for the rows that ask for them (vLLM's default `logprobs_mode`), then the logits
processors (each edits the logits of the rows it applies to, in place: min_tokens masking, logit_bias, repetition,
frequency and presence penalties; grammar bitmasks plug in here, one call filling the whole batch), then greedy
argmax for temperature-0 rows, then temperature, min_p, top-k, top-p and an exponential-race draw (argmax of
p / Exp(1), equivalent to sampling from p). A seeded request draws its noise from its own torch.Generator, so its
tokens do not depend on its neighbours. Every stage is a few batched tensor ops; Python loops run over rows, never
over the vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from server.engine.api import TokenLogprobs
from server.engine.sequence import Sequence


class LogitsProcessor(Protocol):
    """A stage before sampling: edit `logits` [len(seqs), vocab] fp32 in place, row i for seqs[i], leaving the
    rows it does not apply to unchanged. Called once per step for the whole batch; a processor that applies to no
    row returns at once."""

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> None: ...


class Penalties:
    """presence_penalty and frequency_penalty (OpenAI's: subtracted from the logits of tokens already generated)."""

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> None:
        if not any(s.sampling.presence_penalty or s.sampling.frequency_penalty for s in seqs):
            return
        longest = max(seq.num_output_tokens for seq in seqs)
        if longest == 0:
            return
        rows = torch.zeros(len(seqs), longest, dtype=torch.int64)
        valid = torch.zeros(len(seqs), longest)
        for row, seq in enumerate(seqs):
            output = seq.output_token_ids
            rows[row, : len(output)] = torch.tensor(output, dtype=torch.int64)
            valid[row, : len(output)] = 1.0
        counts = torch.zeros_like(logits).scatter_add_(1, rows.to(logits.device), valid.to(logits.device))
        presence = torch.tensor([seq.sampling.presence_penalty for seq in seqs], device=logits.device)
        frequency = torch.tensor([seq.sampling.frequency_penalty for seq in seqs], device=logits.device)
        logits -= frequency.unsqueeze(1) * counts + presence.unsqueeze(1) * (counts > 0)


class RepetitionPenalty:
    """repetition_penalty (vLLM's, from CTRL): the logit of every token in the prompt or the output so far is
    divided by the penalty where positive and multiplied by it where negative."""

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> None:
        rows = [row for row, seq in enumerate(seqs) if seq.sampling.repetition_penalty != 1.0]
        if not rows:
            return
        seen = torch.zeros(len(rows), logits.shape[1], dtype=torch.bool, device=logits.device)
        for i, row in enumerate(rows):
            seen[i, torch.tensor(seqs[row].token_ids, device=logits.device)] = True
        penalty = torch.tensor([seqs[row].sampling.repetition_penalty for row in rows], device=logits.device)
        penalty = penalty.unsqueeze(1).expand_as(seen)
        picked = logits[rows]
        scaled = torch.where(picked > 0, picked / penalty, picked * penalty)
        logits[rows] = torch.where(seen, scaled, picked)


class LogitBias:
    """logit_bias (OpenAI's): each listed token's bias is added to its logit."""

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> None:
        for row, seq in enumerate(seqs):
            bias = seq.sampling.logit_bias
            if bias:
                ids = torch.tensor(list(bias), dtype=torch.int64, device=logits.device)
                logits[row].index_add_(0, ids, torch.tensor(list(bias.values()), device=logits.device))


class MinTokens:
    """min_tokens: EOS (unless ignore_eos) and stop_token_ids cannot be drawn before that many output tokens."""

    def __init__(self, eos_token_ids: list[int]) -> None:
        self.eos_token_ids = eos_token_ids

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> None:
        for row, seq in enumerate(seqs):
            if seq.num_output_tokens < seq.sampling.min_tokens:
                stop_ids = seq.sampling.stop_token_ids + (
                    [] if seq.sampling.ignore_eos else self.eos_token_ids
                )
                if stop_ids:
                    logits[row, stop_ids] = float("-inf")


@dataclass(slots=True)
class SamplerOutput:
    token_ids: list[int]  # one per sequence
    logprobs: list[TokenLogprobs | None]  # one per sequence: None where its request asked for none


def top_logprobs(logprobs: torch.Tensor, token_ids: torch.Tensor, counts: list[int]) -> list[TokenLogprobs]:
    """For each row of `logprobs` [rows, vocab]: the logprob of `token_ids[row]` and the `counts[row]` most likely
    alternatives. One topk and two transfers for the whole batch."""
    chosen = logprobs.gather(1, token_ids.view(-1, 1)).view(-1).tolist()
    k = max(counts)
    values, indices = logprobs.topk(k, dim=-1) if k else (logprobs[:, :0], logprobs[:, :0].long())
    values, indices, ids = values.tolist(), indices.tolist(), token_ids.tolist()
    return [
        TokenLogprobs(ids[row], chosen[row], indices[row][:count], values[row][:count])
        for row, count in enumerate(counts)
    ]


class Sampler:
    def __init__(
        self, eos_token_ids: list[int], device: torch.device, processors: list[LogitsProcessor] | None = None
    ) -> None:
        """`processors`: the stages before sampling, in order (default: min_tokens, logit_bias, then the
        repetition, frequency and presence penalties)."""
        self.eos_token_ids = eos_token_ids
        self.device = device
        self.processors = (
            processors
            if processors is not None
            else [MinTokens(eos_token_ids), LogitBias(), RepetitionPenalty(), Penalties()]
        )

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> SamplerOutput:
        """logits: [len(seqs), vocab] fp32 (modified in place). Returns one token id per sequence, and the
        logprobs the sequences asked for."""
        wanted = [row for row, seq in enumerate(seqs) if seq.sampling.logprobs is not None]
        raw = logits[wanted].log_softmax(dim=-1) if wanted else None  # a copy: before any processor
        for processor in self.processors:
            processor(logits, seqs)
        token_ids = self._draw(logits, seqs)
        logprobs: list[TokenLogprobs | None] = [None] * len(seqs)
        if raw is not None:
            counts = [seqs[row].sampling.logprobs for row in wanted]
            for row, entry in zip(wanted, top_logprobs(raw, token_ids[wanted], counts), strict=True):
                logprobs[row] = entry
        return SamplerOutput(token_ids.tolist(), logprobs)

    def _draw(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        params = [seq.sampling for seq in seqs]
        if all(p.temperature == 0 for p in params):
            return logits.argmax(dim=-1)
        greedy = logits.argmax(dim=-1)
        temperatures = torch.tensor([p.temperature or 1.0 for p in params], device=self.device)
        logits.div_(temperatures.unsqueeze(1))
        if any(p.top_k or p.top_p < 1.0 for p in params):
            self._apply_top_k_top_p(logits, params)
        probs = logits.softmax(dim=-1)
        if any(p.min_p for p in params):
            min_p = torch.tensor([p.min_p for p in params], device=self.device).unsqueeze(1)
            probs.masked_fill_(probs < min_p * probs.amax(dim=-1, keepdim=True), 0.0)
        noise = torch.empty_like(probs).exponential_()
        for row, seq in enumerate(seqs):
            if seq.generator is not None:
                noise[row].exponential_(generator=seq.generator)
        sampled = probs.div_(noise).argmax(dim=-1)
        is_greedy = torch.tensor([p.temperature == 0 for p in params], device=self.device)
        return torch.where(is_greedy, greedy, sampled)

    def _apply_top_k_top_p(self, logits: torch.Tensor, params: list) -> None:
        vocab = logits.shape[1]
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        top_k = torch.tensor(
            [p.top_k if 0 < p.top_k < vocab else vocab for p in params], device=logits.device
        )
        ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)
        sorted_logits.masked_fill_(ranks >= top_k.unsqueeze(1), float("-inf"))
        probs = sorted_logits.softmax(dim=-1)
        top_p = torch.tensor([p.top_p for p in params], device=logits.device)
        before = probs.cumsum(dim=-1) - probs  # probability mass ranked above each token
        sorted_logits.masked_fill_(before > top_p.unsqueeze(1), float("-inf"))
        logits.scatter_(1, order, sorted_logits)
