"""The engine's torch work runs on its own thread: loading (weights converted and packed, the KV pool zeroed)
and every step. libgomp gives each host thread that runs a parallel region its own team of OpenMP workers, and
with more workers than cores they stop spinning at barriers, so a model loaded on the caller's thread made every
later step slower (server/engine/llm_engine.py, `LLMEngine._run`)."""

from __future__ import annotations

import threading

import pytest
from conftest import engine_config, greedy, run

from server.engine import model_runner
from server.engine.llm_engine import LLMEngine
from server.engine.model import LlamaModel


def test_the_model_and_pool_are_built_and_run_on_the_engine_thread(monkeypatch):
    seen: dict[str, str] = {}

    def on_thread(name: str, original):
        def wrapped(self, *args, **kwargs):
            seen[name] = threading.current_thread().name
            return original(self, *args, **kwargs)

        return wrapped

    monkeypatch.setattr(LlamaModel, "__init__", on_thread("model", LlamaModel.__init__))
    monkeypatch.setattr(LlamaModel, "forward", on_thread("forward", LlamaModel.forward))
    runner = model_runner.ModelRunner
    monkeypatch.setattr(runner, "__init__", on_thread("pool", runner.__init__))
    with LLMEngine(engine_config(num_kv_blocks=16)) as engine:
        assert run(engine, greedy(engine.encode("Hello"), "thread-0", max_tokens=2)).num_output_tokens == 2
        engine_thread = engine._thread.name
    assert seen == {"model": engine_thread, "pool": engine_thread, "forward": engine_thread}
    assert engine_thread != threading.current_thread().name


def test_a_load_error_reaches_the_caller_and_leaves_no_thread():
    before = set(threading.enumerate())
    with pytest.raises(FileNotFoundError, match="missing.gguf"):
        LLMEngine(engine_config(model="/nowhere/missing.gguf"))
    assert not [t for t in set(threading.enumerate()) - before if t.name == "strata-engine"]
