"""A peer's NIXL agent in the consumer's fetch process: added when the
peer's hello is answered, connected by a first READ of its region (UCX's
wire-up costs round trips: here, not inside a request's budget), removed
when the peer is dropped or says another hello. Used by the fetching
thread of :mod:`.consumer`."""

from __future__ import annotations

import logging
from typing import Any, Optional

from .fetcher import Fetcher, FetcherError
from .peers import Peer
from .protocol import PeerError

logger = logging.getLogger("vllm.pinshm.ec")

#: Bytes of the READ that makes UCX's connection to a peer after its hello.
WARM_BYTES = 64
#: How long a hello's agent work may take (adding it, the first READ).
HELLO_WORK_S = 5.0


def hello(fetcher: Optional[Fetcher], peer: Peer, reply: dict[str, Any]) -> None:
    """`peer`'s hello answered: its agent added to the fetch process (the
    one it had removed), and UCX's connection to it made by a first READ of
    its region; PeerError (FetcherError: this node's fault) if not."""
    name, meta, base, length, gen = peer.hello(reply)
    drop_agent(fetcher, peer)
    peer.hello_sent = False
    if fetcher is None:
        raise FetcherError("no fetch process")
    added = str(fetcher.ask({"op": "add", "meta": meta}, HELLO_WORK_S)["name"])
    if added != name:
        fetcher.ask({"op": "remove", "name": added}, HELLO_WORK_S)
        raise PeerError(f"its metadata names agent {added!r}, not {name!r}")
    # A first READ makes UCX's connection to the peer (its wire-up costs
    # round trips): here, off any request's budget, not in a fetch.
    warm = {"op": "read", "name": name, "parts": [[base, min(WARM_BYTES, length), 0]], "timeout": HELLO_WORK_S}
    try:
        state = fetcher.ask(warm, HELLO_WORK_S)["state"]
    except FetcherError:
        raise
    except PeerError as e:
        state = repr(e)
    if state != "DONE":
        try:
            fetcher.ask({"op": "remove", "name": added}, HELLO_WORK_S)
        except PeerError:
            pass  # the process went with it
        raise PeerError(f"its region cannot be read (a first READ: {state})")
    peer.agent_name, peer.meta, peer.base, peer.length, peer.gen = name, meta, base, length, gen
    peer.fetcher_start = fetcher.starts


def drop_agent(fetcher: Optional[Fetcher], peer: Peer) -> None:
    """Forgets `peer`'s agent, and removes it from the fetch process that
    added it (one started since never knew it)."""
    name, peer.agent_name = peer.agent_name, None
    # Only the process that added it knows it (one started since has not).
    if name is not None and fetcher is not None and fetcher.alive and peer.fetcher_start == fetcher.starts:
        try:
            fetcher.ask({"op": "remove", "name": name}, HELLO_WORK_S)
        except Exception as e:  # noqa: BLE001 - a miss at worst, never the scheduler's error
            logger.debug("pinshm encoder cache: forgetting agent %s: %r", name, e)
