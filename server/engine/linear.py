"""Linear layers with weights packed once for the CPU's GEMM kernel.

`F.linear` on CPU calls MKL's sgemm, which re-packs the weight on every call for the few-row matmuls of decoding.
oneDNN can reorder a weight once, at load, into the blocked layout its kernel reads; the op is the one
torch.compile's CPU backend emits for frozen linear layers (faster at each row count measured; figures in the
docs/llm.md, "Engine speed on CPU"). The results are fp32 sums in another order (max difference 1e-4 on logits of
magnitude 100), not bitwise equal to F.linear.

Memory: oneDNN keeps state per distinct row count, so resident memory grows with every new row count a step has.
Row counts above `EXACT_ROWS` are therefore padded up to a multiple of `ROW_BUCKET` (zero rows, sliced off the
result), which bounds the distinct counts. Counts up to EXACT_ROWS (decode batches) run as they are.

bf16 on a CPU with AVX512-BF16 and no AMX (where oneDNN's GEMM runs on AMX tiles, it stays): the compiled kernel
of kernels/linear_bf16.cpp instead (`TiledWeight`), whose packing feeds VDPBF16PS directly and whose blocks
prefetch the next weights while computing, faster than oneDNN's packed bf16 GEMM at each row count measured.
One packed copy either way; every row count runs as it is.

`pack` returns the weight to hand to `linear`: tiled for that kernel (bf16, a kernels module given), packed for
oneDNN when the device is a CPU and torch has oneDNN, else the weight itself (CUDA and other builds take F.linear
unchanged).
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch
import torch.nn.functional as F

# oneDNN picks its blocking from a row-count hint; 32 serves prefill as well as 512, and decode batches better.
PACK_ROWS_HINT = 32
EXACT_ROWS = 64
ROW_BUCKET = 64


def can_pack(device: torch.device, dtype: torch.dtype) -> bool:
    """oneDNN packing runs on this CPU for this dtype. Its bf16 path needs avx512bw/vl/dq or avx_ne_convert: on
    an avx2-only CPU bf16 weights stay plain (torch's own kernels), rather than failing at load."""
    return (
        device.type == "cpu"
        and dtype in (torch.float32, torch.bfloat16)
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
        and (dtype != torch.bfloat16 or torch.ops.mkldnn._is_mkldnn_bf16_supported())
    )


@dataclass(frozen=True, slots=True)
class TiledWeight:
    """A bf16 weight [out, in] packed for the compiled kernel: int32 tiles [out/16, in/2, 16]."""

    tiles: torch.Tensor
    out_features: int
    kernels: ModuleType


def can_tile(weight: torch.Tensor, kernels: ModuleType | None) -> bool:
    """The compiled bf16 kernel takes this weight: bf16 on a CPU, built for AVX512-BF16, out a multiple of 16 and
    in even (every Llama-family shape)."""
    return (
        kernels is not None
        and weight.device.type == "cpu"
        and weight.dtype == torch.bfloat16
        and weight.shape[0] % 16 == 0
        and weight.shape[1] % 2 == 0
        and kernels.bf16_linear_available()
    )


def pack(weight: torch.Tensor, packed: bool, kernels: ModuleType | None = None) -> torch.Tensor | TiledWeight:
    """The weight [out, in] as `linear` wants it; a packed weight is opaque (only `linear` can read it).
    `kernels`: the compiled module, whose bf16 kernel is preferred where it applies (`can_tile`)."""
    if not packed:
        return weight
    if can_tile(weight, kernels):
        return TiledWeight(kernels.pack_bf16_linear(weight), weight.shape[0], kernels)
    return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), PACK_ROWS_HINT)


def linear(
    x: torch.Tensor,
    weight: torch.Tensor | TiledWeight,
    bias: torch.Tensor | None = None,
    min_rows: int = 1,
) -> torch.Tensor:
    """x [rows, in] -> [rows, out], for a weight from `pack`. `min_rows` 2: one row is computed as two (a zero
    row after it): oneDNN's packed fp32 GEMM can sum one row over K in another order than it sums each row of two
    or more (docs/benchmarks.md), so a batch-invariant model never hands it a single row."""
    if isinstance(weight, TiledWeight):
        if x.stride(-1) != 1 or x.stride(0) % 2:
            x = x.contiguous()
        out = torch.empty(x.shape[0], weight.out_features, dtype=x.dtype, device=x.device)
        weight.kernels.bf16_linear(x, weight.tiles, bias, out)
        return out
    if not weight.is_mkldnn:
        return F.linear(x, weight, bias)
    rows = x.shape[0]
    padded = max(rows, min_rows) if rows <= EXACT_ROWS else -(-rows // ROW_BUCKET) * ROW_BUCKET
    if padded != rows:
        x = F.pad(x, (0, 0, 0, padded - rows))  # zero rows at the end: one allocation, one copy
    out = torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return out[:rows] if padded != rows else out
