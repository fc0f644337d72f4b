"""kvbm.auth: keys per purpose, the mutual handshake (right secret, wrong secret either way, replay), block MACs."""

from __future__ import annotations

import socket
import threading

import pytest

from kvbm.auth import AuthError, block_mac, check_secret, client_handshake, derive_key, server_handshake

SECRET = b"0123456789abcdef0123456789abcdef"


def handshake(server_key: bytes, client_key: bytes) -> tuple[BaseException | None, BaseException | None]:
    """Run both sides over a socket pair; (server's error, client's error)."""
    server_sock, client_sock = socket.socketpair()
    errors: dict[str, BaseException | None] = {"server": None, "client": None}

    def serve() -> None:
        try:
            server_handshake(server_sock, server_key)
        except BaseException as exc:  # recorded for the assertion
            errors["server"] = exc
        finally:
            server_sock.close()

    thread = threading.Thread(target=serve)
    thread.start()
    try:
        client_handshake(client_sock, client_key)
    except BaseException as exc:
        errors["client"] = exc
    finally:
        client_sock.close()
    thread.join(5)
    return errors["server"], errors["client"]


def test_keys_differ_per_purpose_and_per_secret():
    assert derive_key(SECRET, "a") != derive_key(SECRET, "b")
    assert derive_key(SECRET, "a") != derive_key(SECRET + b"x", "a")
    assert derive_key(SECRET, "a") == derive_key(SECRET, "a") and len(derive_key(SECRET, "a")) == 32


def test_a_short_secret_is_refused_with_how_to_make_one():
    with pytest.raises(ValueError, match="at least 16 bytes.*secrets.token_hex"):
        check_secret(b"short\n", "--cluster-secret-file s")
    assert check_secret(SECRET + b"\n", "x") == SECRET


def test_the_same_secret_passes_both_ways():
    key = derive_key(SECRET, "kvbm-service")
    assert handshake(key, key) == (None, None)


def test_a_client_with_the_wrong_secret_is_refused():
    server_error, client_error = handshake(
        derive_key(SECRET, "k"), derive_key(b"another-secret-0123456789", "k")
    )
    assert isinstance(server_error, AuthError) and "client's proof" in str(server_error)
    assert isinstance(client_error, AuthError)  # the server closed without proving anything


def test_a_server_with_the_wrong_secret_is_refused_by_the_client():
    """The client checks the server's proof too: a fake service cannot answer queries."""
    server_sock, client_sock = socket.socketpair()
    right, wrong = derive_key(SECRET, "k"), derive_key(b"another-secret-0123456789", "k")

    def fake_server() -> None:  # accepts any client proof, then proves with the wrong key
        from kvbm import auth

        nonce_s = b"\x01" * 32
        server_sock.sendall(b"STRATA-AUTH-1" + nonce_s)
        nonce_c = auth._recv_exact(server_sock, 64)[:32]
        server_sock.sendall(auth._proof(wrong, b"server", nonce_c, nonce_s))

    thread = threading.Thread(target=fake_server)
    thread.start()
    with pytest.raises(AuthError, match="server's proof"):
        client_handshake(client_sock, right)
    thread.join(5)
    server_sock.close()
    client_sock.close()


def test_block_macs_bind_key_layout_hash_and_payload():
    key = derive_key(SECRET, "g4-mac")
    mac = block_mac(key, 7, 42, b"payload")
    assert len(mac) == 16
    assert mac != block_mac(derive_key(SECRET + b"!", "g4-mac"), 7, 42, b"payload")
    assert mac != block_mac(key, 8, 42, b"payload")
    assert mac != block_mac(key, 7, 43, b"payload")
    assert mac != block_mac(key, 7, 42, b"payloaD")
