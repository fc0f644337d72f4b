"""`dtype: auto` resolves to bf16 only where the hardware computes in it."""

from __future__ import annotations

import pytest
import torch

from server.engine import config as engine_config
from server.engine.config import EngineConfig, auto_dtype
from server.errors import ConfigError


def test_auto_is_the_default_and_resolves_to_a_concrete_dtype():
    config = EngineConfig(device="cpu")
    assert config.dtype == "auto"
    assert config.torch_dtype in (torch.float32, torch.bfloat16)


@pytest.mark.parametrize(
    "cpuinfo, mkldnn_bf16, expected",
    [
        ("flags\t\t: fpu sse avx avx2 fma f16c\n", True, torch.float32),  # AVX2 only: software bf16
        ("flags\t\t: avx2 avx512f avx512bw avx512_bf16\n", True, torch.bfloat16),
        ("flags\t\t: avx2 avx512f amx_bf16 amx_tile\n", True, torch.bfloat16),
        ("Features\t: fp asimd bf16 i8mm\n", True, torch.bfloat16),  # aarch64
        ("flags\t\t: avx512_bf16\n", False, torch.float32),  # torch's oneDNN cannot use it
    ],
)
def test_cpu_picks_bf16_only_with_native_bf16(monkeypatch, tmp_path, cpuinfo, mkldnn_bf16, expected):
    fake = tmp_path / "cpuinfo"
    fake.write_text("processor\t: 0\n" + cpuinfo)
    real_path = engine_config.Path
    monkeypatch.setattr(engine_config, "Path", lambda p: fake if p == "/proc/cpuinfo" else real_path(p))
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: mkldnn_bf16)
    assert auto_dtype("cpu") is expected


def test_a_dtype_that_is_not_known_names_the_choices():
    with pytest.raises(
        ConfigError, match="dtype: must be one of auto, float32, fp32, bfloat16, bf16, got 'fp16'"
    ):
        EngineConfig.from_dict({"dtype": "fp16"})
