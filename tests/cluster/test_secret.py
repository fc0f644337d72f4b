"""cluster.secret: keys per purpose and per secret, and a short secret refused with how to make one."""

from __future__ import annotations

import pytest

from cluster.secret import check_secret, derive_key

SECRET = b"0123456789abcdef0123456789abcdef"


def test_keys_differ_per_purpose_and_per_secret():
    assert derive_key(SECRET, "a") != derive_key(SECRET, "b")
    assert derive_key(SECRET, "a") != derive_key(SECRET + b"x", "a")
    assert derive_key(SECRET, "a") == derive_key(SECRET, "a") and len(derive_key(SECRET, "a")) == 32


def test_a_short_secret_is_refused_with_how_to_make_one():
    with pytest.raises(ValueError, match="at least 16 bytes.*secrets.token_hex"):
        check_secret(b"short\n", "--cluster-secret-file s")
    assert check_secret(SECRET + b"\n", "x") == SECRET
