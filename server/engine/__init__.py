"""Strata's LLM engine: paged KV cache, prefix caching, continuous batching, own torch forward.

Import from the modules: `server.engine.api` is the protocol every caller needs (and all the OpenAI frontend may
see); `LLMEngine` (llm_engine.py) and `EngineConfig` (config.py) build the engine itself, which loads torch;
`server.engine.stream` turns a submit into sync/async iterators. This file imports nothing, so that importing the
protocol does not load the engine.
"""
