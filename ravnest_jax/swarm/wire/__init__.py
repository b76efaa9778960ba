"""The wire: what both sides of the swarm share. Request signing (``_auth``), signed JSON and
streamed bodies (``_http``), the messages' and records' types (``_types``), the codec value and
the wire format as the swarm sees it (``_codec``), the run manifest as a peer declares it
(``_manifest``) and the relay's addresses and headers (``_relay``).

Imports neither :mod:`~ravnest_jax.swarm.peer` nor :mod:`~ravnest_jax.swarm.rendezvous`
(tests/house/test_layering.py).
"""
