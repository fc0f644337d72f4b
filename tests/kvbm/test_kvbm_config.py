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
        ({"object_url": "s3://bucket/kv"}, "kvbm config object_url: G5 blocks are signed"),
        (
            {"object_url": "http://127.0.0.1:9000/kv"},
            "kvbm config object_url: 'http://127.0.0.1:9000/kv' is not s3://",
        ),
        ({"object_timeout_s": 0.0}, "kvbm config object_timeout_s: must be > 0.0"),
    ],
)
def test_a_bad_value_names_its_field(fields: dict[str, object], message: str) -> None:
    with pytest.raises(KVBMConfigError) as raised:
        KVBMConfig(**fields).validate()
    assert str(raised.value).startswith(message) and raised.value.field == next(iter(fields))


def test_a_disk_path_given_as_text_becomes_a_path_and_the_block_key_stays_out_of_repr() -> None:
    config = KVBMConfig(disk_path="kv", redis_url="redis://127.0.0.1:1", block_key=b"k" * 32)  # type: ignore[arg-type]
    config.validate()
    assert config.disk_path == Path("kv")
    assert "kkkk" not in repr(config) and "block_key=<set>" in repr(config)


def test_tiers_that_fail_to_open_leave_no_g2_segment(tmp_path: Path, cache_id: str, layout) -> None:
    """A G3 that cannot open (its path is a file) fails the bind, and the G2 segment opened before it is gone."""
    from kvbm_testing import make_kv_cache

    from kvbm.connector import KVBMConnector
    from kvbm.host_pool import SHM_DIR

    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    config = KVBMConfig(cache_id=cache_id, host_cache_gb=0.001, disk_cache_gb=0.001, disk_path=blocker)
    connector = KVBMConnector(config, "w")
    with pytest.raises(OSError):
        connector.bind(make_kv_cache(layout, 4), layout)
    assert not list(SHM_DIR.glob(f"strata-kvbm-{cache_id}-*"))
