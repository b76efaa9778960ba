"""The peer: ``Swarm`` (``_peer``) and its parts: the transport (``_transport``), the round
driver (``_rounds``, ``_attempt``), the all-reduce algorithms (``_butterfly``, ``_fold``,
``_ring``, ``_allreduce``), a contribution (``_contrib``), membership, state
transfer, pipeline activations and the checks before long work (``_preflight``).

Imports :mod:`~ravnest_jax.swarm.wire` only, never :mod:`~ravnest_jax.swarm.rendezvous`
(tests/house/test_layering.py).
"""
