"""The rendezvous service: membership and heartbeats (``_rendezvous``), the round handlers
(``_rounds``) and their decisions over the votes (``_votes``), the relay for client-only peers
(``_relay``), the status page (``_status``, ``status.html``) and the server (``_serve``).

Imports :mod:`~ravnest_jax.swarm.wire` only, never :mod:`~ravnest_jax.swarm.peer`
(tests/house/test_layering.py).
"""
