"""Packed CPU linear layers compute what F.linear computes (up to fp32 summation order)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

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
