"""The fuzz tests' Triton server is the LLM tests' own fixture (tests/server/test_llm_triton.py): `strata serve`
with SmolLM2 on free ports, one per test module, always stopped."""

from tests.server.test_llm_triton import server  # noqa: F401
