"""server/workers/transport.py: a bound PUSH whose peer is gone never blocks a send, nor the close behind it."""

from __future__ import annotations

import threading
import time

from server.workers.protocol import Ack
from server.workers.transport import Channel, ChannelAddress


def test_a_server_whose_spawned_worker_is_gone_drops_its_send_and_closes() -> None:
    """The race seen in tests/workers/test_discovery.py's teardown: the receiver thread sent an Ack to a worker
    that had just exited (a bound PUSH without a peer blocked for ever, holding the send lock) while `close`
    waited for that lock."""
    channel = Channel(ChannelAddress.fresh(), server_side=True)  # the server binds; no worker ever connects
    started = time.monotonic()
    sender = threading.Thread(target=channel.send, args=(Ack(),), daemon=True)
    sender.start()
    sender.join(30)
    assert not sender.is_alive(), "a send to a peer that is gone blocked"
    closer = threading.Thread(target=channel.close, daemon=True)
    closer.start()
    closer.join(30)
    assert not closer.is_alive() and time.monotonic() - started < 30
