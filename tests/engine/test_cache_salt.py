"""Tenant isolation of the prefix cache: requests share cached blocks only when their `cache_salt`s are equal."""

from __future__ import annotations

import msgspec
import pytest
from conftest import LONG_TEXT, greedy, run

from kvbm.block_hash import block_hashes, model_salt, request_salt
from server.engine.api import GenerationRequest, RequestError, validate_cache_salt
from server.engine.llm_engine import LLMEngine


def test_no_salt_keeps_the_model_root_and_salts_change_every_block():
    root = model_salt("test")
    tokens = list(range(64))
    plain = block_hashes(tokens, 16, root)
    assert request_salt(root, None) == root
    tenant_a = block_hashes(tokens, 16, request_salt(root, "tenant-a"))
    tenant_b = block_hashes(tokens, 16, request_salt(root, "tenant-b"))
    assert tenant_a == block_hashes(tokens, 16, request_salt(root, "tenant-a"))
    assert not {*plain} & {*tenant_a} and not {*plain} & {*tenant_b} and not {*tenant_a} & {*tenant_b}
    assert request_salt(model_salt("other"), "tenant-a") != request_salt(root, "tenant-a")


def _salted(ids: list[int], request_id: str, cache_salt: str | None) -> GenerationRequest:
    return msgspec.structs.replace(greedy(ids, request_id, max_tokens=2), cache_salt=cache_salt)


def test_only_requests_with_the_same_salt_share_cached_tokens(engine: LLMEngine):
    ids = engine.encode("Cache salt isolation. " + LONG_TEXT)  # a prefix no other test caches
    full = (len(ids) - 1) // engine.config.block_size * engine.config.block_size  # never the last token

    def cached(request_id: str, cache_salt: str | None) -> int:
        return run(engine, _salted(ids, request_id, cache_salt)).num_cached_tokens

    first = run(engine, _salted(ids, "plain-0", None))
    assert first.num_cached_tokens == 0
    assert cached("a-0", "tenant-a") == 0  # the unsalted blocks are not shared with a salt
    assert cached("b-0", "tenant-b") == 0  # nor one salt's with another
    assert cached("a-1", "tenant-a") == full
    assert cached("b-1", "tenant-b") == full
    assert cached("plain-1", None) == full  # unsalted requests share as before
    again = run(engine, _salted(ids, "a-2", "tenant-a"))
    assert again.new_token_ids == first.new_token_ids  # a salt changes what is shared, not the answer


@pytest.mark.parametrize(
    ("cache_salt", "message"),
    [
        ("", "1 to 256"),
        ("x" * 257, "1 to 256"),
        (7, "string"),
        ("\ud800", "Unicode"),
    ],
)
def test_a_bad_salt_is_refused_naming_the_field(engine: LLMEngine, cache_salt, message: str):
    with pytest.raises(RequestError) as raised:
        engine.submit(_salted([1, 2, 3], "bad-salt", cache_salt), lambda output: None)
    assert raised.value.field == "cache_salt" and message in raised.value.message
    validate_cache_salt("x" * 256)
