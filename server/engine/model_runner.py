"""Owns the model and the KV pool; turns a list of scheduled chunks into one forward pass.

KV pool layout (mandatory, shared with the KVBM connector, see kv_connector.py):

    kv_cache[num_blocks, num_layers, 2 (K, V), block_size, num_kv_heads, head_dim]   block-major, one tensor

so `kv_cache[block_id]` is one block's bytes for every layer; the model writes K/V of layer l through the strided
view `kv_cache[:, l, 0|1]`.
"""

from __future__ import annotations

import torch

from server.engine.model import LlamaModel, PrefillChunk, StepBatch
from server.engine.scheduler import ScheduledChunk


class ModelRunner:
    def __init__(self, model: LlamaModel, num_blocks: int, block_size: int) -> None:
        shape = model.shape
        self.model = model
        self.block_size = block_size
        self.device = model.device
        self.kv_cache = torch.zeros(
            num_blocks, shape.num_layers, 2, block_size, shape.num_kv_heads, shape.head_dim,
            dtype=model.dtype, device=model.device,
        )  # fmt: skip

    @staticmethod
    def block_bytes(model: LlamaModel, block_size: int) -> int:
        """Bytes of one block across all layers (K and V)."""
        s = model.shape
        elem = torch.empty((), dtype=model.dtype).element_size()
        return s.num_layers * 2 * block_size * s.num_kv_heads * s.head_dim * elem

    def run(self, chunks: list[ScheduledChunk]) -> torch.Tensor:
        """Forward the step; returns logits [S, vocab] for the chunks that end at their sequence's last token,
        in the order of `chunks`."""
        batch = self._prepare(chunks)
        return self.model.forward(batch, self.kv_cache)

    def _prepare(self, chunks: list[ScheduledChunk]) -> StepBatch:
        decodes = [c for c in chunks if c.num_tokens == 1]
        prefills = [c for c in chunks if c.num_tokens > 1]
        token_ids: list[int] = []
        positions: list[torch.Tensor] = []
        slot_blocks: list[torch.Tensor] = []
        decode_tables = decode_mask = None
        if decodes:
            decode_tables, decode_mask = self._decode_tables(decodes)
            pos = torch.tensor([c.seq.num_computed_tokens for c in decodes])
            token_ids.extend(c.seq.token_ids[c.seq.num_computed_tokens] for c in decodes)
            positions.append(pos)
            slot_blocks.append(decode_tables.gather(1, (pos // self.block_size).unsqueeze(1)).squeeze(1))
        prefill_chunks: list[PrefillChunk] = []
        row = len(decodes)
        for chunk in prefills:
            seq, start = chunk.seq, chunk.seq.num_computed_tokens
            end = start + chunk.num_tokens
            pos = torch.arange(start, end)
            table = torch.tensor(seq.block_table[: -(-end // self.block_size)])
            token_ids.extend(seq.token_ids[start:end])
            positions.append(pos)
            slot_blocks.append(table[pos // self.block_size])
            mask = None
            if start:
                keys = torch.arange(table.numel() * self.block_size)
                mask = (keys.unsqueeze(0) <= pos.unsqueeze(1)).to(self.device)
            prefill_chunks.append(PrefillChunk(row, chunk.num_tokens, start, table.to(self.device), mask))
            row += chunk.num_tokens
        all_positions = torch.cat(positions)
        return StepBatch(
            token_ids=torch.tensor(token_ids, device=self.device),
            positions=all_positions.to(self.device),
            slot_blocks=torch.cat(slot_blocks).to(self.device),
            slot_offsets=(all_positions % self.block_size).to(self.device),
            num_decode=len(decodes),
            decode_block_tables=decode_tables.to(self.device) if decodes else None,
            decode_mask=decode_mask,
            prefills=prefill_chunks,
            logits_rows=self._logits_rows(chunks, decodes, prefills),
        )

    def _decode_tables(self, decodes: list[ScheduledChunk]) -> tuple[torch.Tensor, torch.Tensor]:
        """Padded block tables [B, max_blocks] and the key mask [B, 1, 1, max_blocks*block_size]."""
        lengths = [c.seq.num_computed_tokens + 1 for c in decodes]
        width = -(-max(lengths) // self.block_size)
        tables = torch.zeros(len(decodes), width, dtype=torch.int64)
        for row, chunk in enumerate(decodes):
            used = -(-lengths[row] // self.block_size)
            tables[row, :used] = torch.tensor(chunk.seq.block_table[:used])
        keys = torch.arange(width * self.block_size)
        mask = keys.unsqueeze(0) < torch.tensor(lengths).unsqueeze(1)
        return tables, mask.view(len(decodes), 1, 1, -1).to(self.device)

    def _logits_rows(self, chunks, decodes, prefills) -> torch.Tensor:
        """Row of each sampling chunk's last token, in `chunks` order (decode rows come first in the batch)."""
        row_of: dict[int, int] = {}
        for row, chunk in enumerate(decodes):
            row_of[id(chunk)] = row
        row = len(decodes)
        for chunk in prefills:
            row += chunk.num_tokens
            row_of[id(chunk)] = row - 1
        rows = [row_of[id(c)] for c in chunks if c.seq.num_computed_tokens + c.num_tokens == c.seq.num_tokens]
        return torch.tensor(rows, dtype=torch.int64, device=self.device)
