"""Find a model's weights and tokenizer on disk; convert a GGUF once into a safetensors cache folder.

A model spec is one of:
  pkg://<package>/<file.gguf>   a file shipped inside an installed Python package (found without importing it)
  /path/to/model.gguf           a GGUF file
  /path/to/folder               a Hugging Face folder: config.json, *.safetensors, tokenizer.json

A GGUF is dequantized once through transformers' GGUF support (offline) and written as config.json +
model.safetensors + tokenizer files to `<cache_dir>/<name>-<size>-<mtime_ns>/`, via a temp dir and an atomic rename,
so a crash never leaves a half-written cache. Later loads read that folder directly (well under a second).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from server import settings

log = logging.getLogger(__name__)


@dataclass(slots=True)
class ModelFiles:
    """A folder holding config.json, *.safetensors and tokenizer files, ready to load."""

    folder: Path
    name: str  # short model id used in fingerprints and logs


def resolve_spec(spec: str) -> Path:
    """Turn a model spec into an existing file or folder path; raise FileNotFoundError naming the spec."""
    if spec.startswith("pkg://"):
        package, _, rel = spec[len("pkg://") :].partition("/")
        found = importlib.util.find_spec(package)
        if found is None or not found.submodule_search_locations:
            raise FileNotFoundError(f"model spec {spec!r}: package {package!r} is not installed")
        path = Path(next(iter(found.submodule_search_locations))) / rel
    else:
        path = Path(spec).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"model spec {spec!r}: {path} does not exist")
    return path


def prepare_model(spec: str, cache_dir: Path | None = None) -> ModelFiles:
    """Return a safetensors folder for `spec`, converting a GGUF into the cache on first use."""
    path = resolve_spec(spec)
    if path.is_dir():
        return ModelFiles(folder=path, name=path.name)
    if path.suffix != ".gguf":
        raise ValueError(f"model spec {spec!r}: expected a .gguf file or a Hugging Face folder")
    stat = path.stat()
    target = (cache_dir or settings.cache_dir()) / f"{path.stem}-{stat.st_size}-{stat.st_mtime_ns}"
    if not (target / "model.safetensors").exists():
        _convert_gguf(path, target)
    return ModelFiles(folder=target, name=path.stem)


def _convert_gguf(gguf: Path, target: Path) -> None:
    """Dequantize `gguf` with transformers (offline) and write it to `target` atomically."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("converting %s to a safetensors cache at %s (one time, ~15 s)", gguf, target)
    started = time.monotonic()
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
        log.info("tokenizer converted in %.1f s; dequantizing weights", time.monotonic() - started)
        model = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, local_files_only=True, dtype=torch.float32
        )
        log.info("weights dequantized in %.1f s; writing safetensors", time.monotonic() - started)
        _save_safetensors(model, tmp)
        tokenizer.save_pretrained(tmp)
        try:
            os.replace(tmp, target)
        except OSError:  # another process finished first: keep its folder
            if not (target / "model.safetensors").exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("GGUF conversion done in %.1f s", time.monotonic() - started)


def _save_safetensors(model, folder: Path) -> None:
    """Write config.json and model.safetensors (transformers refuses save_pretrained on a GGUF-loaded model)."""
    from safetensors.torch import save_file

    config = model.config.to_dict()
    config.pop("quantization_config", None)
    (folder / "config.json").write_text(json.dumps(config, indent=2, default=str))
    state = {name: t.detach().contiguous() for name, t in model.state_dict().items()}
    if config.get("tie_word_embeddings"):
        state.pop("lm_head.weight", None)
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})


def load_config(files: ModelFiles) -> dict:
    """The Hugging Face config.json of the model, as a dict."""
    return json.loads((files.folder / "config.json").read_text())


def open_weights(files: ModelFiles) -> dict[str, Any]:
    """Every tensor of every *.safetensors file by name, unread: each a slice handle that reads (memory-mapped)
    only the rows or columns it is indexed with (`w[a:b]`, `w[:, a:b]`, `w[:]` for all). A rank of a sharded model
    reads its part of each weight this way, never the whole model."""
    shards = sorted(files.folder.glob("*.safetensors"))
    if not shards:
        raise FileNotFoundError(f"{files.folder}: no *.safetensors files")
    handles: dict[str, Any] = {}
    for shard in shards:
        opened = safe_open(str(shard), framework="pt")
        handles.update({name: opened.get_slice(name) for name in opened.keys()})  # noqa: SIM118
    return handles


def load_weights(files: ModelFiles) -> dict[str, torch.Tensor]:
    """All tensors of every *.safetensors file in the folder, by name (CPU, stored dtype)."""
    shards = sorted(files.folder.glob("*.safetensors"))
    if not shards:
        raise FileNotFoundError(f"{files.folder}: no *.safetensors files")
    weights: dict[str, torch.Tensor] = {}
    for shard in shards:
        weights.update(load_file(shard))
    return weights
