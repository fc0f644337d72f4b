"""KVBMConfig's checks: each bad value names its field; the G4 key never shows in a repr."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvbm.config import KVBMConfig, KVBMConfigError


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"host_cache_gb": -1.0}, "kvbm config host_cache_gb: must be >= 0.0"),
        ({"redis_ttl_s": -1}, "kvbm config redis_ttl_s: must be >= 0"),
        ({"flush_budget_s": -0.5}, "kvbm config flush_budget_s: must be >= 0.0"),
        ({"disk_min_uses": 0}, "kvbm config disk_min_uses: must be >= 1"),
        ({"cache_id": "a/b"}, "kvbm config cache_id: must be a non-empty name without '/'"),
        ({"write_through": "yes"}, "kvbm config write_through: expected `bool`, got `str`"),
        ({"redis_url": "redis://127.0.0.1:1"}, "kvbm config redis_url: G4 blocks are signed"),
    ],
)
def test_a_bad_value_names_its_field(fields: dict[str, object], message: str) -> None:
    with pytest.raises(KVBMConfigError) as raised:
        KVBMConfig(**fields).validate()
    assert str(raised.value).startswith(message) and raised.value.field == next(iter(fields))


def test_a_disk_path_given_as_text_becomes_a_path_and_the_g4_key_stays_out_of_repr() -> None:
    config = KVBMConfig(disk_path="kv", redis_url="redis://127.0.0.1:1", g4_key=b"k" * 32)  # type: ignore[arg-type]
    config.validate()
    assert config.disk_path == Path("kv")
    assert "kkkk" not in repr(config) and "g4_key=<set>" in repr(config)
