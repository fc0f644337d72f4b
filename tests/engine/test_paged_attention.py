"""The compiled decode kernel against torch's SDPA over the same keys gathered from the pool."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

LAYERS, BLOCK_SIZE, KV_HEADS, HEAD_DIM, HEADS = 3, 16, 3, 64, 9


def reference(query, pool, layer, tables, lengths, scale):
    """Gather each row's keys in token order, then SDPA with GQA: [B, H, D]."""
    rows = []
    for b, length in enumerate(lengths.tolist()):
        blocks = tables[b, : -(-length // BLOCK_SIZE)]
        keys = pool[blocks, layer, 0].reshape(-1, KV_HEADS, HEAD_DIM)[:length].transpose(0, 1).float()
        values = pool[blocks, layer, 1].reshape(-1, KV_HEADS, HEAD_DIM)[:length].transpose(0, 1).float()
        q = query[b].float().unsqueeze(1)  # [H, 1, D]
        rows.append(F.scaled_dot_product_attention(q, keys, values, scale=scale, enable_gqa=True)[:, 0])
    return torch.stack(rows)


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_matches_sdpa_on_ragged_lengths_and_scattered_blocks(kernels, dtype, tolerance):
    torch.manual_seed(0)
    pool = torch.randn(64, LAYERS, 2, BLOCK_SIZE, KV_HEADS, HEAD_DIM).to(dtype)
    lengths = torch.tensor([1, 15, 16, 17, 100, 333], dtype=torch.int64)  # partial, full and one-token blocks
    width = int(-(-lengths.max() // BLOCK_SIZE))
    tables = torch.stack([torch.randperm(64)[:width] for _ in lengths])  # blocks in no particular order
    query = torch.randn(len(lengths), HEADS, HEAD_DIM).to(dtype)
    scale = HEAD_DIM**-0.5
    for layer in range(LAYERS):
        out = torch.empty_like(query)
        kernels.decode_attention(query, pool, layer, tables, lengths, scale, out)
        expected = reference(query, pool, layer, tables, lengths, scale)
        torch.testing.assert_close(out.float(), expected, atol=tolerance, rtol=tolerance)


def test_padding_past_a_row_length_is_never_read(kernels):
    """Table entries past a row's length may be anything (here: out of range); they are not touched."""
    pool = torch.randn(8, LAYERS, 2, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    tables = torch.tensor([[3, 10**9, -5], [1, 2, 4]], dtype=torch.int64)
    lengths = torch.tensor([16, 40], dtype=torch.int64)
    query = torch.randn(2, HEADS, HEAD_DIM)
    out = torch.empty_like(query)
    kernels.decode_attention(query, pool, 1, tables, lengths, 0.125, out)
    expected = reference(query, pool, 1, tables.clamp(0, 7), lengths, 0.125)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_bad_shapes_are_refused_naming_the_argument(kernels):
    pool = torch.randn(8, LAYERS, 2, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    query = torch.randn(1, HEADS, HEAD_DIM)
    tables, lengths = torch.zeros(1, 1, dtype=torch.int64), torch.ones(1, dtype=torch.int64)
    with pytest.raises(RuntimeError, match="block_tables"):
        kernels.decode_attention(query, pool, 0, tables.int(), lengths, 0.1, torch.empty_like(query))
    with pytest.raises(RuntimeError, match="layer"):
        kernels.decode_attention(query, pool, LAYERS, tables, lengths, 0.1, torch.empty_like(query))
    with pytest.raises(RuntimeError, match="dtype"):
        kernels.decode_attention(
            query.double(), pool, 0, tables, lengths, 0.1, torch.empty_like(query).double()
        )


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_one_sequence_split_by_kv_head_matches_sdpa(kernels, dtype, tolerance):
    """Fewer sequences than threads: each kv head is a task of its own (the decode of a single stream)."""
    torch.manual_seed(1)
    pool = torch.randn(32, LAYERS, 2, BLOCK_SIZE, KV_HEADS, HEAD_DIM).to(dtype)
    lengths = torch.tensor([250], dtype=torch.int64)
    tables = torch.randperm(32)[: -(-250 // BLOCK_SIZE)].unsqueeze(0).contiguous()
    query = torch.randn(1, HEADS, HEAD_DIM).to(dtype)
    out = torch.empty_like(query)
    kernels.decode_attention(query, pool, 2, tables, lengths, HEAD_DIM**-0.5, out)
    expected = reference(query, pool, 2, tables, lengths, HEAD_DIM**-0.5)
    torch.testing.assert_close(out.float(), expected, atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize(
    "heads, kv_heads, head_dim, block_size",
    [
        (9, 3, 64, 16),  # SmolLM2: a compile-time shape (3 query heads per kv head, head_dim 64)
        (8, 8, 64, 16),  # no GQA
        (32, 8, 128, 16),  # Llama-3-8B's shape: 4 per kv head, head_dim 128
        (14, 2, 64, 32),  # 7 per kv head, two 16-key groups per block
        (20, 1, 128, 16),  # 20 per kv head: past the compile-time shapes, the runtime-shaped kernel
        (6, 3, 96, 16),  # head_dim 96: the runtime-shaped kernel
        (9, 3, 64, 8),  # blocks of 8 keys: the runtime-shaped kernel
    ],
)
def test_bf16_shapes_match_sdpa(kernels, heads, kv_heads, head_dim, block_size):
    """Every bf16 path (the compile-time shapes and the runtime-shaped fallback), batched and alone, ragged."""
    torch.manual_seed(heads + head_dim + block_size)
    blocks = 96
    pool = torch.randn(blocks, LAYERS, 2, block_size, kv_heads, head_dim).to(torch.bfloat16)
    scale = head_dim**-0.5
    for lengths in ([1, 15, 16, 17, 47, 250], [250]):
        lengths = torch.tensor(lengths, dtype=torch.int64)
        width = int(-(-lengths.max() // block_size))
        tables = torch.stack([torch.randperm(blocks)[:width] for _ in lengths])
        query = torch.randn(len(lengths), heads, head_dim).to(torch.bfloat16)
        out = torch.empty_like(query)
        kernels.decode_attention(query, pool, 1, tables, lengths, scale, out)
        expected = []
        for b, length in enumerate(lengths.tolist()):
            rows = pool[tables[b, : -(-length // block_size)], 1]  # [nb, 2, block_size, kv_heads, head_dim]
            keys = rows[:, 0].reshape(-1, kv_heads, head_dim)[:length].transpose(0, 1).float()
            values = rows[:, 1].reshape(-1, kv_heads, head_dim)[:length].transpose(0, 1).float()
            q = query[b].float().unsqueeze(1)
            expected.append(
                F.scaled_dot_product_attention(q, keys, values, scale=scale, enable_gqa=True)[:, 0]
            )
        torch.testing.assert_close(out.float(), torch.stack(expected), atol=2e-2, rtol=2e-2)
