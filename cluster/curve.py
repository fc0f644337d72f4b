"""ZMQ CURVE keys from the cluster secret, and the ZAP check that admits only the cluster's client key: the one
scheme of Strata's ZMQ links over TCP (server <-> worker channels, server/workers/transport.py; KV handoffs between
workers, kvbm/transfer_tcp.py; the KVBM service's query port, kvbm/query_port.py), each link with its own key
purposes.

The CURVE server side admits only the client key the secret gives, so a peer without the secret never completes
the handshake (no frame of it reaches a decoder), and a peer that learnt the server's public key but not the
secret is turned away by the ZAP check; every admitted frame is encrypted and authenticated.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import zmq
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85

from cluster.secret import derive_key

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class CurveKeys:
    """CURVE key pairs (z85): the CURVE server's, and the one pair every client of the link uses."""

    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes

    @classmethod
    def derive(cls, secret: bytes, server_purpose: str, client_purpose: str) -> CurveKeys:
        server_secret = z85.encode(derive_key(secret, server_purpose))
        client_secret = z85.encode(derive_key(secret, client_purpose))
        return cls(
            zmq.curve_public(server_secret), server_secret, zmq.curve_public(client_secret), client_secret
        )


def make_server(sock: zmq.Socket, keys: CurveKeys, zap_domain: bytes) -> None:
    """Make `sock` (before it binds or connects) the link's CURVE server; the ZAP handler of `zap_domain`
    (`admit_cluster`) checks each peer's key."""
    sock.curve_server = True
    sock.curve_publickey = keys.server_public
    sock.curve_secretkey = keys.server_secret
    sock.zap_domain = zap_domain


def make_client(sock: zmq.Socket, keys: CurveKeys) -> None:
    """Make `sock` (before it connects or binds) a CURVE client of the link's server, with the cluster's client
    key pair."""
    sock.curve_serverkey = keys.server_public
    sock.curve_publickey = keys.client_public
    sock.curve_secretkey = keys.client_secret


def admit_cluster(context: zmq.Context, keys: CurveKeys, zap_domain: bytes, link: str) -> ThreadAuthenticator:
    """Start the ZAP handler of `context`: its CURVE servers of `zap_domain` admit only the cluster's client
    key (`link` names them in the log). Stop it before terminating the context."""
    authenticator = ThreadAuthenticator(context, log=logging.getLogger("zmq.auth"))
    authenticator.start()
    authenticator.configure_curve_callback(
        zap_domain.decode(), credentials_provider=AdmitOneKey(keys.client_public, link)
    )
    return authenticator


class AdmitOneKey:
    """ZAP credentials check of a CURVE server socket: only the cluster's client key. A peer with another secret
    fails earlier, in the CURVE handshake itself, and reaches no callback."""

    def __init__(self, client_public: bytes, link: str) -> None:
        self.client_public = client_public
        self.link = link

    def callback(self, domain: str, key: bytes) -> bool:
        if key == self.client_public:
            return True
        log.warning(
            "refused a %s whose CURVE key is not the cluster's (wrong or no cluster secret)", self.link
        )
        return False
