"""Next-token choice for a batch of sequences, vectorized over rows.

Order: the logits processors (each edits the raw logits of the rows it applies to, in place: penalties, min_tokens
masking; grammar bitmasks plug in here, one call filling the whole batch), then greedy argmax for temperature-0
rows, then temperature, top-k, top-p and an exponential-race draw (argmax of p / Exp(1), equivalent to sampling
from p). A seeded request draws its noise from its own torch.Generator, so its tokens do not depend on its
neighbours.
"""

from __future__ import annotations

from typing import Protocol

import torch

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


class Sampler:
    def __init__(
        self, eos_token_ids: list[int], device: torch.device, processors: list[LogitsProcessor] | None = None
    ) -> None:
        """`processors`: the stages before sampling, in order (default: penalties, then min_tokens)."""
        self.eos_token_ids = eos_token_ids
        self.device = device
        self.processors = processors if processors is not None else [Penalties(), MinTokens(eos_token_ids)]

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
        """logits: [len(seqs), vocab] fp32 (modified in place). Returns one token id per sequence."""
        for processor in self.processors:
            processor(logits, seqs)
        params = [seq.sampling for seq in seqs]
        if all(p.temperature == 0 for p in params):
            return logits.argmax(dim=-1).tolist()
        greedy = logits.argmax(dim=-1)
        temperatures = torch.tensor([p.temperature or 1.0 for p in params], device=self.device)
        logits.div_(temperatures.unsqueeze(1))
        if any(p.top_k or p.top_p < 1.0 for p in params):
            self._apply_top_k_top_p(logits, params)
        probs = logits.softmax(dim=-1)
        noise = torch.empty_like(probs).exponential_()
        for row, seq in enumerate(seqs):
            if seq.generator is not None:
                noise[row].exponential_(generator=seq.generator)
        sampled = probs.div_(noise).argmax(dim=-1)
        is_greedy = torch.tensor([p.temperature == 0 for p in params], device=self.device)
        return torch.where(is_greedy, greedy, sampled).tolist()

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
