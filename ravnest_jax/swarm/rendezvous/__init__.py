"""The rendezvous service: membership, heartbeats and the server (``_rendezvous``), the rounds
(``_rounds``: the run model, the round handlers and the decisions over the votes), the relay for client-only
peers (``_relay``), the status page (``_status``, ``status.html``).

Imports :mod:`~ravnest_jax.swarm.wire` only, never :mod:`~ravnest_jax.swarm.peer`
(tests/house/test_layering.py).
"""
