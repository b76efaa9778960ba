"""The relay's part of the wire: the mailbox address a client-only peer advertises at the
rendezvous, and the headers that carry a relayed request and its answer (the rendezvous' relay,
``rendezvous/_relay.py``, holds and forwards them; a client-only peer's transport collects them).
"""

from __future__ import annotations

from typing import Any

H_ID, H_METHOD, H_PATH, H_HEADERS, H_STATUS = (
    "X-RJ-Relay-Id",
    "X-RJ-Relay-Method",
    "X-RJ-Relay-Path",
    "X-RJ-Relay-Headers",
    "X-RJ-Relay-Status",
)
FORWARDED = ("Content-Type",)  # plus every X-RJ-* header


def relay_address(rendezvous_url: str, run_id: str, peer_id: str) -> str:
    """The address a client-only peer advertises: its mailbox at the rendezvous."""
    return f"{rendezvous_url.rstrip('/')}/relay/{run_id}/{peer_id}"


def is_relay_address(address: str, run_id: str, peer_id: str) -> bool:
    """Whether ``address`` is the relay mailbox of ``peer_id`` in ``run_id`` (at any rendezvous URL)."""
    return address.rstrip("/").endswith(f"/relay/{run_id}/{peer_id}")


def forwarded_headers(headers: Any) -> dict[str, str]:
    """The headers a relay passes on (the signature's and the message's own, ``X-RJ-*``)."""
    return {k: v for k, v in headers.items() if k.startswith("X-RJ-") or k in FORWARDED}
