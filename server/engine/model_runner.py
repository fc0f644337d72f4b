"""Owns the model and the KV pool; turns a list of scheduled chunks into one forward pass.

KV pool layout (mandatory, shared with the KVBM connector, see kvbm/api.py):

    kv_cache[num_blocks, num_layers, 2 (K, V), block_size, num_kv_heads, head_dim]   block-major, one tensor

so `kv_cache[block_id]` is one block's bytes for every layer; the model writes K/V of layer l through the strided
view `kv_cache[:, l, 0|1]`.
"""

from __future__ import annotations

import torch

from server.engine.api import RankStats
from server.engine.model import DecodeGroup, LlamaModel, PrefillChunk, StepBatch
from server.engine.scheduler import ScheduledChunk

# A decode row joins the group of shorter rows unless that pads them by more than this many blocks in all
# (padding costs a gather and attention over masked keys; a new group costs one more gather and SDPA per layer).
MAX_GROUP_PADDING_BLOCKS = 32


class ModelRunner:
    """Implements `server.engine.executor.ModelExecutor` in the engine's own process (and a rank's part of a
    sharded model in each rank's)."""

    shard_layout = ""  # the whole model, in this process

    def __init__(self, model: LlamaModel, num_blocks: int, block_size: int) -> None:
        shape = model.local  # this rank's layers and KV heads (the whole model unsharded)
        self.model = model
        self.block_size = block_size
        self.device = model.device
        self.kv_cache = torch.zeros(
            num_blocks, shape.num_layers, 2, block_size, shape.num_kv_heads, shape.head_dim,
            dtype=model.dtype, device=model.device,
        )  # fmt: skip

    @staticmethod
    def block_bytes(model: LlamaModel, block_size: int) -> int:
        """Bytes of one block across this rank's layers (K and V of its KV heads)."""
        s = model.local
        elem = torch.empty((), dtype=model.dtype).element_size()
        return s.num_layers * 2 * block_size * s.num_kv_heads * s.head_dim * elem

    def run(self, chunks: list[ScheduledChunk]) -> torch.Tensor:
        """Forward the step; returns logits [S + P, vocab]: S rows for the chunks that end at their sequence's last
        token, in the order of `chunks`, then P rows of prompt positions whose logprobs are owed (each chunk's
        `seq.prompt_logprob_positions`, in the order of `chunks`)."""
        return self.model.forward(self.prepare(chunks), self.kv_cache)

    def recover(self) -> None:
        """Nothing to restart: it runs in the engine's own process and never raises ExecutorFailure."""

    def ranks(self) -> list[RankStats]:
        return []

    def restarts(self) -> dict[str, int]:
        return {}

    def begin_close(self) -> None:
        """Nothing runs beside the engine thread."""

    def close(self) -> None:
        """The pool goes with the engine."""

    def prepare(self, chunks: list[ScheduledChunk]) -> StepBatch:
        """The step's inputs as tensors on the model's device (what every rank of a sharded worker gets)."""
        if self.model.batch_invariant and self.model.prefill_kernel is None:
            return self._prepare_rows(chunks)
        if self.model.batch_invariant:  # every row, a decode's too, through the prefill kernel (model.py)
            decodes, prefills = [], list(chunks)
        else:  # decode rows sorted by length, so that rows of similar length are attended together
            decodes = sorted(
                (c for c in chunks if c.num_tokens == 1), key=lambda c: c.seq.num_computed_tokens
            )
            prefills = [c for c in chunks if c.num_tokens > 1]
        bs = self.block_size
        token_ids = [c.seq.token_ids[c.seq.num_computed_tokens] for c in decodes]
        decode_positions = [c.seq.num_computed_tokens for c in decodes]
        positions: list[torch.Tensor] = [torch.tensor(decode_positions, dtype=torch.int64)]
        decode_slots = [c.seq.block_table[p // bs] for c, p in zip(decodes, decode_positions, strict=True)]
        slot_blocks: list[torch.Tensor] = [torch.tensor(decode_slots, dtype=torch.int64)]
        prefill_chunks: list[PrefillChunk] = []
        row = len(decodes)
        for chunk in prefills:
            seq, start = chunk.seq, chunk.seq.num_computed_tokens
            end = start + chunk.num_tokens
            pos = torch.arange(start, end)
            table = torch.tensor(seq.block_table[: -(-end // bs)])
            token_ids.extend(seq.token_ids[start:end])
            positions.append(pos)
            slot_blocks.append(table[pos // bs])
            mask = None
            if start and self.model.prefill_kernel is None:  # the kernel masks by position itself
                keys = torch.arange(table.numel() * bs)
                mask = (keys.unsqueeze(0) <= pos.unsqueeze(1)).to(self.device)
            prefill_chunks.append(PrefillChunk(row, chunk.num_tokens, start, table.to(self.device), mask))
            row += chunk.num_tokens
        all_positions = torch.cat(positions)
        return StepBatch(
            token_ids=torch.tensor(token_ids, device=self.device),
            positions=all_positions.to(self.device),
            slot_blocks=torch.cat(slot_blocks).to(self.device),
            slot_offsets=(all_positions % bs).to(self.device),
            num_decode=len(decodes),
            decode_groups=self._decode_groups(decodes),
            prefills=prefill_chunks,
            logits_rows=self._logits_rows(chunks, decodes, prefills),
        )

    def _prepare_rows(self, chunks: list[ScheduledChunk]) -> StepBatch:
        """Batch-invariant without the prefill kernel (fp32, or a CPU without AVX512-BF16): every row of every
        chunk is a row of its own for the decode kernel, attending to its `position + 1` keys in the pool (the
        step writes every row's K/V there first), so a token's attention is one computation whether it comes in a
        prompt chunk of any size, after a cached prefix, or decoding, and whatever else is in the step."""
        bs = self.block_size
        token_ids: list[int] = []
        positions: list[torch.Tensor] = []
        tables: list[tuple[torch.Tensor, int]] = []  # per chunk: its block table (to its last row), its rows
        first_row: dict[int, int] = {}
        rows = 0
        for chunk in chunks:
            seq, start = chunk.seq, chunk.seq.num_computed_tokens
            end = start + chunk.num_tokens
            first_row[id(chunk)] = rows
            token_ids.extend(seq.token_ids[start:end])
            positions.append(torch.arange(start, end))
            tables.append(
                (torch.tensor(seq.block_table[: -(-end // bs)], dtype=torch.int64), chunk.num_tokens)
            )
            rows += chunk.num_tokens
        # each row gets its chunk's table; the kernel reads only its `lengths` keys, never the blocks past them
        block_tables = torch.zeros(rows, max(table.numel() for table, _ in tables), dtype=torch.int64)
        row = 0
        for table, count in tables:
            block_tables[row : row + count, : table.numel()] = table
            row += count
        all_positions = torch.cat(positions)
        slot_blocks = block_tables[torch.arange(rows), all_positions // bs]
        lengths = all_positions + 1
        group = DecodeGroup(0, rows, block_tables.to(self.device), None, lengths)
        return StepBatch(
            token_ids=torch.tensor(token_ids, device=self.device),
            positions=all_positions.to(self.device),
            slot_blocks=slot_blocks.to(self.device),
            slot_offsets=(all_positions % bs).to(self.device),
            num_decode=rows,
            decode_groups=[group],
            prefills=[],
            logits_rows=self._rows_of(chunks, first_row),
        )

    def _decode_groups(self, decodes: list[ScheduledChunk]) -> list[DecodeGroup]:
        """Split decode rows (sorted by length) into groups whose padding stays under MAX_GROUP_PADDING_BLOCKS;
        one group of every row when the compiled kernel attends (it reads no padding)."""
        bs = self.block_size
        lengths = [c.seq.num_computed_tokens + 1 for c in decodes]  # keys each row attends to, ascending
        if self.model.decode_kernel is not None:
            return [self._kernel_group(decodes, lengths)] if decodes else []
        blocks = [-(-n // bs) for n in lengths]
        groups: list[DecodeGroup] = []
        start = 0
        for end in range(1, len(decodes) + 1):
            if end < len(decodes):
                padding = sum(blocks[end] - b for b in blocks[start:end])
                if padding <= MAX_GROUP_PADDING_BLOCKS:
                    continue
            groups.append(self._decode_group(decodes, lengths, start, end))
            start = end
        return groups

    def _decode_group(self, decodes, lengths: list[int], start: int, end: int) -> DecodeGroup:
        """Rows [start, end): block tables padded to the longest, and the key mask (None when nothing is padded)."""
        tables = self._block_tables(decodes, lengths, start, end)
        width = tables.shape[1]
        mask = None
        if any(n != width * self.block_size for n in lengths[start:end]):
            keys = torch.arange(width * self.block_size)
            mask = keys.unsqueeze(0) < torch.tensor(lengths[start:end]).unsqueeze(1)
            mask = mask.view(end - start, 1, 1, -1).to(self.device)
        return DecodeGroup(start, end - start, tables.to(self.device), mask)

    def _kernel_group(self, decodes, lengths: list[int]) -> DecodeGroup:
        """Every decode row: block tables padded with block 0 (never read) and each row's key count."""
        tables = self._block_tables(decodes, lengths, 0, len(decodes))
        return DecodeGroup(0, len(decodes), tables, None, torch.tensor(lengths, dtype=torch.int64))

    def _block_tables(self, decodes, lengths: list[int], start: int, end: int) -> torch.Tensor:
        """[end - start, blocks of the longest row] int64: rows [start, end)'s block tables, padded with block 0."""
        tables = torch.zeros(end - start, -(-lengths[end - 1] // self.block_size), dtype=torch.int64)
        for row in range(start, end):
            used = -(-lengths[row] // self.block_size)
            tables[row - start, :used] = torch.tensor(decodes[row].seq.block_table[:used])
        return tables

    def _logits_rows(self, chunks, decodes, prefills) -> torch.Tensor:
        """Row of each sampling chunk's last token, in `chunks` order (decode rows come first in the batch), then
        the rows of owed prompt logprobs."""
        first_row: dict[int, int] = {}  # chunk -> its first row in the batch
        for row, chunk in enumerate(decodes):
            first_row[id(chunk)] = row
        row = len(decodes)
        for chunk in prefills:
            first_row[id(chunk)] = row
            row += chunk.num_tokens
        return self._rows_of(chunks, first_row)

    def _rows_of(self, chunks, first_row: dict[int, int]) -> torch.Tensor:
        """The sampling rows and owed prompt-logprob rows of `chunks`, given each chunk's first row."""
        rows = [
            first_row[id(c)] + c.num_tokens - 1
            for c in chunks
            if c.seq.num_computed_tokens + c.num_tokens == c.seq.num_tokens
        ]
        for c in chunks:
            start = c.seq.num_computed_tokens
            positions = c.seq.prompt_logprob_positions(start, start + c.num_tokens)
            rows.extend(first_row[id(c)] + p - start for p in positions)
        return torch.tensor(rows, dtype=torch.int64, device=self.device)
