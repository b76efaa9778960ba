"""The global-state endpoint of a peer: served only with the run token, streamed, checked."""

from __future__ import annotations

import concurrent.futures
import time
import urllib.error
import urllib.request

import pytest

from ._local import local_swarm

pytestmark = pytest.mark.integration  # real swarms (processes or threads): minutes in all


@pytest.mark.timeout(120)
def test_fetch_state_from_a_live_peer_and_refuse_unsigned_requests():
    body = bytes(range(256)) * 5000  # 1.28 MB: several chunks
    with local_swarm(2) as (a, b):
        # a live peer that serves nothing yet answers 404 at once: nobody to download from
        t0 = time.monotonic()
        assert b.fetch_state(timeout=20) is None
        assert time.monotonic() - t0 < 10, time.monotonic() - t0
        calls = []

        def provider():
            calls.append(1)
            fut: concurrent.futures.Future = concurrent.futures.Future()
            fut.set_result(body)
            return fut

        a.serve_state(provider)
        assert b.fetch_state(timeout=20) == body
        n = len(calls)
        for headers in ({}, {"X-RJ-Peer": "p1", "X-RJ-Signature": "0" * 64}):
            req = urllib.request.Request(f"http://127.0.0.1:{a.port}/v1/runs/sync-test/state", headers=headers)
            with pytest.raises(urllib.error.HTTPError) as e:
                urllib.request.urlopen(req, timeout=10)
            assert e.value.code == 401
            e.value.close()
        assert len(calls) == n  # an unauthorised request never reached the provider
        a.serve_state(None)
        b.serve_state(lambda: b"from b")
        assert a.fetch_state(timeout=20) == b"from b"
