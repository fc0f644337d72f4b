"""Packed CPU linear layers compute what F.linear computes (up to fp32 summation order)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import cpu_flags

from server.engine import linear


@pytest.mark.skipif(
    not linear.can_pack(torch.device("cpu"), torch.float32), reason="torch built without oneDNN"
)
@pytest.mark.parametrize("rows", [1, 7, 32, 64, 65, 300])
@pytest.mark.parametrize("with_bias", [False, True])
def test_packed_linear_matches_f_linear(rows: int, with_bias: bool) -> None:
    generator = torch.Generator().manual_seed(rows)
    weight = torch.randn(960, 576, generator=generator)
    bias = torch.randn(960, generator=generator) if with_bias else None
    x = torch.randn(rows, 576, generator=generator)
    packed = linear.pack(weight, packed=True)
    assert packed.is_mkldnn
    out = linear.linear(x, packed, bias)
    torch.testing.assert_close(out, F.linear(x, weight, bias), rtol=1e-5, atol=1e-4)
    assert out.shape == (rows, 960) and out.dtype == torch.float32


def test_unpacked_weight_takes_f_linear() -> None:
    weight = torch.randn(8, 4)
    assert linear.pack(weight, packed=False) is weight
    x = torch.randn(3, 4)
    assert torch.equal(linear.linear(x, weight), F.linear(x, weight))


def test_cuda_and_other_dtypes_are_not_packed() -> None:
    assert not linear.can_pack(torch.device("cuda"), torch.float32)
    assert not linear.can_pack(torch.device("cpu"), torch.float16)


@pytest.mark.parametrize("rows", [1, 2, 3, 7, 8, 9, 31, 64, 65, 300])
@pytest.mark.parametrize("out_features", [960, 48])  # 48: an odd number of 16-column tiles
@pytest.mark.parametrize("with_bias", [False, True])
def test_tiled_bf16_linear_matches_fp32_up_to_one_rounding(kernels, rows, out_features, with_bias) -> None:
    """The compiled bf16 kernel: fp32 sums of bf16 products, rounded once, so within half a bf16 step (2^-9
    relative) of the fp32 product of the same bf16 inputs; every row remainder (blocks of 8, 4, 2, 1)."""
    if not kernels.bf16_linear_available():
        if {"avx512_bf16", "avx512bw"} <= cpu_flags():
            pytest.fail("this CPU has AVX512-BF16 but the kernels were built without the bf16 linear")
        pytest.skip("this CPU has no avx512_bf16: bf16 linears run on oneDNN")
    generator = torch.Generator().manual_seed(rows + out_features)
    weight = torch.randn(out_features, 576, generator=generator).to(torch.bfloat16)
    bias = torch.randn(out_features, generator=generator).to(torch.bfloat16) if with_bias else None
    x = torch.randn(rows, 576, generator=generator).to(torch.bfloat16)
    packed = linear.pack(weight, packed=True, kernels=kernels)
    assert isinstance(packed, linear.TiledWeight)
    out = linear.linear(x, packed, bias)
    assert out.shape == (rows, out_features) and out.dtype == torch.bfloat16
    exact = x.float() @ weight.float().T + (bias.float() if with_bias else 0)
    assert ((out.float() - exact).abs() <= exact.abs() * 2**-8 + 1e-3).all()
    # a strided view of x (every other row) computes the same rows
    wide = torch.zeros(rows, 2, 576, dtype=torch.bfloat16)
    wide[:, 0] = x
    assert torch.equal(linear.linear(wide[:, 0], packed, bias), out)


def test_tiling_is_refused_where_the_kernel_does_not_apply(kernels) -> None:
    assert not linear.can_tile(torch.randn(40, 576).to(torch.bfloat16), kernels)  # 40 not a multiple of 16
    assert not linear.can_tile(torch.randn(48, 575).to(torch.bfloat16), kernels)  # odd in_features
    assert not linear.can_tile(torch.randn(48, 576), kernels)  # fp32: oneDNN
    assert not linear.can_tile(torch.randn(48, 576).to(torch.bfloat16), None)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        kernels.pack_bf16_linear(torch.randn(40, 576).to(torch.bfloat16))
    packed = kernels.pack_bf16_linear(torch.randn(48, 576).to(torch.bfloat16))
    with pytest.raises(RuntimeError, match="x has 512 columns"):
        kernels.bf16_linear(torch.zeros(2, 512, dtype=torch.bfloat16), packed, None, torch.empty(2, 48))
