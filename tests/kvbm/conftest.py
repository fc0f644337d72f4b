from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
from kvbm_testing import small_layout

from kvbm.api import KVLayout
from kvbm.host_pool import remove_segments


@pytest.fixture
def layout() -> KVLayout:
    return small_layout()


@pytest.fixture
def cache_id() -> Iterator[str]:
    """A unique G2 segment name; the segment is removed after the test."""
    name = f"test-{uuid.uuid4().hex[:12]}"
    yield name
    remove_segments(name)
