"""The rendezvous service: membership, heartbeats and the server (``_rendezvous``), the round
handlers (``_rounds``) and their run model and decisions (``_votes``), the relay for client-only
peers (``_relay``), the status page (``_status``, ``status.html``).

Imports :mod:`~ravnest_jax.swarm.wire` only, never :mod:`~ravnest_jax.swarm.peer`
(tests/house/test_layering.py).
"""
