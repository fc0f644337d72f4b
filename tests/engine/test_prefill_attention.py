"""The compiled bf16 prefill attention (kernels/prefill_attention.cpp) against SDPA over the same keys gathered
from the pool, on every instruction set it can use here (AMX tiles, AVX512-BF16 registers), and the engine's
choice of it.

The kernel is built where the compiler targets AVX512-BF16 (AMX as well where the CPU has it); on any other CPU the
comparisons are skipped (the engine then keeps SDPA, which the last test checks either way). A CPU that reports
the features but gets no kernel fails rather than skips."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import cpu_flags, engine_config

from server.engine.llm_engine import LLMEngine

LAYERS, BLOCK_SIZE = 3, 16


# what each instruction set needs of the CPU (the build also needs avx512bw and avx512vl, which these CPUs have)
ISA_FLAGS = {"amx": {"amx_bf16", "amx_tile", "avx512_bf16"}, "avx512_bf16": {"avx512_bf16", "avx512bw"}}


class Kernel:
    """The module with one instruction set chosen: `prefill_attention(...)` runs on `isa`."""

    def __init__(self, module, isa: str) -> None:
        self.module, self.isa = module, isa

    def __getattr__(self, name):
        return getattr(self.module, name)

    def prefill_attention(self, *args):
        return self.module.prefill_attention(*args, isa=self.isa)


@pytest.fixture(scope="module", params=sorted(ISA_FLAGS))
def kernel(kernels, request):
    isa = request.param
    if isa not in kernels.prefill_attention_isas():
        if ISA_FLAGS[isa] <= cpu_flags():
            pytest.fail(
                f"this CPU reports {sorted(ISA_FLAGS[isa])} but the build or the OS gives no {isa} kernel"
            )
        pytest.skip(f"this CPU has no {isa}")
    return Kernel(kernels, isa)


def run(kernel, query, pool, layer, table, context_len, scale):
    out = torch.full_like(query, float("nan"))
    keys = context_len + query.shape[0]
    workspace = torch.empty(
        kernel.prefill_workspace_bytes(keys, pool.shape[4], pool.shape[5]), dtype=torch.uint8
    )
    kernel.prefill_attention(query, pool, layer, table, context_len, scale, out, workspace)
    return out


def reference(query, pool, layer, table, context_len, scale, dtype):
    """Gather the sequence's keys in token order, causal mask by position, SDPA with GQA in `dtype`: [T, H, D]."""
    tokens, kv_heads, head_dim = query.shape[0], pool.shape[4], pool.shape[5]
    keys = pool[table, layer, 0].reshape(-1, kv_heads, head_dim)[: context_len + tokens].transpose(0, 1)
    values = pool[table, layer, 1].reshape(-1, kv_heads, head_dim)[: context_len + tokens].transpose(0, 1)
    positions = torch.arange(context_len, context_len + tokens)
    mask = torch.arange(context_len + tokens).unsqueeze(0) <= positions.unsqueeze(1)
    q = query.transpose(0, 1).unsqueeze(0).to(dtype)
    out = F.scaled_dot_product_attention(
        q,
        keys.unsqueeze(0).to(dtype),
        values.unsqueeze(0).to(dtype),
        attn_mask=mask,
        scale=scale,
        enable_gqa=True,
    )
    return out[0].transpose(0, 1).float()


@pytest.mark.parametrize(
    "tokens, context_len, heads, kv_heads, head_dim",
    [
        (1, 0, 9, 3, 64),  # one row: a single key
        (2, 0, 9, 3, 64),
        (16, 0, 9, 3, 64),  # exactly one row block
        (17, 3, 9, 3, 64),  # a row block of one, keys past a block edge
        (100, 0, 9, 3, 64),
        (128, 37, 9, 3, 64),  # cached prefix not a multiple of the block or the 32-key step
        (300, 1000, 9, 3, 64),  # long prefix: several 128-key steps before the diagonal
        (513, 0, 9, 3, 64),
        (40, 20, 4, 2, 128),  # head_dim 128: two groups of P V tiles
        (33, 0, 4, 4, 64),  # no GQA
    ],
)
def test_matches_sdpa_on_scattered_blocks(kernel, tokens, context_len, heads, kv_heads, head_dim):
    torch.manual_seed(tokens + context_len)
    blocks = 160
    pool = torch.randn(blocks, LAYERS, 2, BLOCK_SIZE, kv_heads, head_dim).to(torch.bfloat16)
    table = torch.randperm(blocks)[: -(-(context_len + tokens) // BLOCK_SIZE)]  # blocks in no order
    query = (torch.randn(tokens, heads, head_dim) * 2).to(torch.bfloat16)  # sharper softmax than unit scale
    scale = head_dim**-0.5
    ours = run(kernel, query, pool, 1, table, context_len, scale).float()
    exact = reference(query, pool, 1, table, context_len, scale, torch.float32)
    sdpa_bf16 = reference(query, pool, 1, table, context_len, scale, torch.bfloat16)
    assert not ours.isnan().any(), "rows left unwritten"
    # bf16 output rounding bounds both; the kernel is no further from fp32 than SDPA in bf16 (P in bf16 too)
    ours_error = (ours - exact).abs().max().item()
    sdpa_error = (sdpa_bf16 - exact).abs().max().item()
    assert ours_error <= 1.5 * sdpa_error + 2e-3, (ours_error, sdpa_error)


def test_a_row_never_sees_a_later_key(kernel):
    """Keys after a row's position hold huge values: if the mask let one in, that row's output would show it."""
    torch.manual_seed(1)
    tokens, context_len = 70, 50
    pool = torch.randn(16, LAYERS, 2, BLOCK_SIZE, 3, 64).to(torch.bfloat16)
    table = torch.arange(-(-(context_len + tokens) // BLOCK_SIZE))
    query = torch.randn(tokens, 9, 64).to(torch.bfloat16)
    before = run(kernel, query, pool, 0, table, context_len, 0.125).float()
    for row in (0, 17, tokens - 2):
        poisoned = pool.clone()
        for token in range(context_len + row + 1, context_len + tokens):
            block, offset = table[token // BLOCK_SIZE], token % BLOCK_SIZE
            poisoned[block, 0, 0, offset] = 10
            poisoned[block, 0, 1, offset] = 1e4
        after = run(kernel, query, poisoned, 0, table, context_len, 0.125).float()
        assert torch.equal(after[: row + 1], before[: row + 1])
        assert after[row + 1 :].abs().max() > 100  # the later rows do see them


def test_refuses_bad_arguments(kernel):
    pool = torch.zeros(8, LAYERS, 2, BLOCK_SIZE, 3, 64, dtype=torch.bfloat16)
    query = torch.zeros(20, 9, 64, dtype=torch.bfloat16)
    table = torch.arange(2)
    workspace = torch.empty(kernel.prefill_workspace_bytes(20, 3, 64), dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="bf16 only"):
        kernel.prefill_attention(query.float(), pool, 0, table, 0, 0.125, query.float(), workspace)
    with pytest.raises(RuntimeError, match="block_table too short"):
        kernel.prefill_attention(query, pool, 0, table, 20, 0.125, query.clone(), workspace)
    with pytest.raises(RuntimeError, match="workspace too small"):
        kernel.prefill_attention(query, pool, 0, table, 0, 0.125, query.clone(), workspace[:100])
    with pytest.raises(RuntimeError, match="layer out of range"):
        kernel.prefill_attention(query, pool, LAYERS, table, 0, 0.125, query.clone(), workspace)
    with pytest.raises(RuntimeError, match="isa 'sse2' is not available"):
        kernel.module.prefill_attention(query, pool, 0, table, 0, 0.125, query.clone(), workspace, isa="sse2")


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_the_engine_uses_it_for_bf16_where_built(kernels, dtype):
    """bf16 on an AVX512-BF16 (or AMX) build: the kernel; fp32 (token-identical to transformers) or a CPU without
    bf16 dot products: SDPA; off by config."""
    expected = dtype == "bfloat16" and kernels.prefill_attention_available()
    with LLMEngine(engine_config(dtype=dtype, num_kv_blocks=64)) as engine:
        assert (engine.model.prefill_kernel is not None) == expected
    with LLMEngine(engine_config(dtype=dtype, num_kv_blocks=64, prefill_kernel=False)) as engine:
        assert engine.model.prefill_kernel is None
