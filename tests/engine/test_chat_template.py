"""model.json's chat_template (vLLM's --chat-template): a Jinja template, or a file of one next to model.json,
used instead of the model's own."""

from __future__ import annotations

import json

import pytest
from conftest import engine_config

from server.engine.config import EngineConfig
from server.engine.llm_engine import LLMEngine
from server.errors import ConfigError

TEMPLATE = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}[assistant]"


def test_a_chat_template_file_next_to_model_json_is_read(tmp_path) -> None:
    (tmp_path / "template.jinja").write_text(TEMPLATE)
    (tmp_path / "model.json").write_text(json.dumps({"chat_template": "template.jinja"}))
    assert EngineConfig.from_json(tmp_path / "model.json").chat_template == TEMPLATE
    (tmp_path / "model.json").write_text(json.dumps({"chat_template": TEMPLATE}))
    assert EngineConfig.from_json(tmp_path / "model.json").chat_template == TEMPLATE
    (tmp_path / "model.json").write_text(json.dumps({"chat_template": "missing.jinja"}))
    with pytest.raises(ConfigError, match="chat_template"):
        EngineConfig.from_json(tmp_path / "model.json")


def test_the_engine_renders_chat_with_the_given_template(engine) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    with LLMEngine(engine_config(chat_template=TEMPLATE, num_kv_blocks=16)) as templated:
        ids = templated.apply_chat_template(messages)
    assert templated.decode(ids) == "[system] Be brief.\n[user] Hi\n[assistant]"
    assert engine.apply_chat_template(messages) != ids  # the model's own template otherwise
