"""Next-token choice for a batch of sequences, vectorized over rows.

Order: penalties (presence, frequency) and min_tokens masking, then greedy argmax for temperature-0 rows, then
temperature, top-k, top-p and an exponential-race draw (argmax of p / Exp(1), equivalent to sampling from p).
A seeded request draws its noise from its own torch.Generator, so its tokens do not depend on its neighbours.
"""

from __future__ import annotations

import torch

from server.engine.sequence import Sequence


class Sampler:
    def __init__(self, eos_token_ids: list[int], device: torch.device) -> None:
        self.eos_token_ids = eos_token_ids
        self.device = device

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> list[int]:
        """logits: [len(seqs), vocab] fp32 (modified in place). Returns one token id per sequence."""
        params = [seq.sampling for seq in seqs]
        if any(p.presence_penalty or p.frequency_penalty for p in params):
            self._apply_penalties(logits, seqs)
        if any(p.min_tokens for p in params):
            self._mask_early_stops(logits, seqs)
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

    def _apply_penalties(self, logits: torch.Tensor, seqs: list[Sequence]) -> None:
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

    def _mask_early_stops(self, logits: torch.Tensor, seqs: list[Sequence]) -> None:
        for row, seq in enumerate(seqs):
            if seq.num_output_tokens < seq.sampling.min_tokens:
                stop_ids = seq.sampling.stop_token_ids + (
                    [] if seq.sampling.ignore_eos else self.eos_token_ids
                )
                if stop_ids:
                    logits[row, stop_ids] = float("-inf")

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
