"""The cluster secret and the keys derived from it.

One secret, many keys: each use gets its own 32-byte key, `derive_key(secret, purpose)` (keyed BLAKE2b), so a key that
leaks from one use (say, a G4 MAC key in a Redis module) does not open another (the worker links). The purposes in
use are listed in docs/SECURITY.md.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

MIN_SECRET_BYTES = 16


def check_secret(secret: bytes, where: str) -> bytes:
    """The secret itself, stripped of surrounding whitespace; ValueError (naming `where`) if too short."""
    secret = secret.strip()
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(
            f"{where}: the cluster secret must be at least {MIN_SECRET_BYTES} bytes, got {len(secret)}; "
            "make one with: python -c 'import secrets; print(secrets.token_hex(32))' > strata.secret"
        )
    return secret


def load_secret(path: Path | None, env_value: str | None, needed_by: str | None) -> bytes | None:
    """The cluster secret from the file at `path` (--cluster-secret-file), else `env_value`
    (STRATA_CLUSTER_SECRET, read by the caller's CLI); None if neither and nothing needs it. ValueError, naming
    the source or `needed_by` and saying how to make a secret, otherwise."""
    if path is not None:
        try:
            return check_secret(path.read_bytes(), f"--cluster-secret-file {path}")
        except OSError as exc:
            raise ValueError(f"--cluster-secret-file {path}: {exc.strerror}") from exc
    if env_value:
        return check_secret(env_value.encode(), "STRATA_CLUSTER_SECRET")
    if needed_by is None:
        return None
    raise ValueError(
        f"{needed_by} needs a cluster secret (every link between machines is authenticated): "
        "python -c 'import secrets; print(secrets.token_hex(32))' > strata.secret; chmod 600 strata.secret; "
        "then pass --cluster-secret-file strata.secret to every strata process (or set STRATA_CLUSTER_SECRET)"
    )


def derive_key(secret: bytes, purpose: str) -> bytes:
    """32-byte key for one `purpose` ("zmq-curve-worker", "g4-mac", ...)."""
    root = hashlib.blake2b(secret, digest_size=64, person=b"strata-secret").digest()
    return hashlib.blake2b(purpose.encode(), key=root, digest_size=32).digest()
