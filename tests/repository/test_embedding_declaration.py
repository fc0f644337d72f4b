"""A model's `openai_api: embeddings` declaration (server/embeddings.py): what makes it an embedding model, and a
declaration that does not fit its inputs and outputs refused naming config.pbtxt and the field."""

from __future__ import annotations

from pathlib import Path

import pytest

from server.embeddings import embedding_spec
from server.errors import ConfigError
from server.repository.scan import ModelSource, scan

DECLARED = 'parameters { key: "openai_api" value: { string_value: "embeddings" } }'
TEXT_IN = 'input [ { name: "TEXT" data_type: TYPE_STRING dims: [ 1 ] } ]'
VECTOR_OUT = 'output [ { name: "E" data_type: TYPE_FP32 dims: [ 8 ] } ]'


def model(tmp_path: Path, *lines: str, batch: int = 4) -> ModelSource:
    folder = tmp_path / "repo" / "m"
    (folder / "1").mkdir(parents=True, exist_ok=True)
    (folder / "1" / "model.py").write_text("")
    (folder / "config.pbtxt").write_text("\n".join(['backend: "python"', f"max_batch_size: {batch}", *lines]))
    (found,) = scan([tmp_path / "repo"], auto_complete=False).values()
    assert isinstance(found, ModelSource), found
    return found


def test_a_declared_text_model_and_one_that_counts_tokens(tmp_path: Path) -> None:
    assert embedding_spec(model(tmp_path, TEXT_IN, VECTOR_OUT, DECLARED)).tokens_output is None
    counted = 'output [ { name: "E" data_type: TYPE_FP32 dims: [ 8 ] }, { name: "N" data_type: TYPE_INT64 dims: [ 1 ] } ]'
    spec = embedding_spec(model(tmp_path, TEXT_IN, counted, DECLARED))
    assert (spec.output_name, spec.dimensions, spec.tokens_output, spec.takes_tokens) == ("E", 8, "N", False)
    ids = 'input [ { name: "IDS" data_type: TYPE_INT64 dims: [ -1 ] } ]'
    assert embedding_spec(model(tmp_path, ids, VECTOR_OUT, DECLARED)).takes_tokens


def test_an_undeclared_model_is_not_one(tmp_path: Path) -> None:
    assert embedding_spec(model(tmp_path, TEXT_IN, VECTOR_OUT)) is None


@pytest.mark.parametrize(
    ("lines", "batch", "field"),
    [
        ((TEXT_IN, VECTOR_OUT, DECLARED.replace('"embeddings"', '"chat"')), 4, 'parameters "openai_api"'),
        ((TEXT_IN, VECTOR_OUT, DECLARED), 0, "max_batch_size"),
        (
            ('input [ { name: "T" data_type: TYPE_STRING dims: [ 2 ] } ]', VECTOR_OUT, DECLARED),
            4,
            "input 'T'",
        ),
        ((TEXT_IN, 'output [ { name: "E" data_type: TYPE_FP32 dims: [ 2, 4 ] } ]', DECLARED), 4, "output"),
        ((TEXT_IN, 'output [ { name: "E" data_type: TYPE_INT32 dims: [ 8 ] } ]', DECLARED), 4, "output"),
    ],
)
def test_a_declaration_that_does_not_fit_names_the_file_and_field(
    tmp_path: Path, lines: tuple[str, ...], batch: int, field: str
) -> None:
    with pytest.raises(ConfigError) as raised:
        embedding_spec(model(tmp_path, *lines, batch=batch))
    assert str(raised.value).startswith(f"{tmp_path / 'repo' / 'm' / 'config.pbtxt'}: {field}")
