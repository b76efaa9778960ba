"""The activation link between two stage peers (two Swarms in this process, a rendezvous
process): delivery, who may send what, deadlines, stale epochs."""

from __future__ import annotations

import time

import numpy as np
import pytest

from ravnest_jax.compress import encode
from ravnest_jax.swarm import Swarm, Timeouts
from ravnest_jax.swarm.peer._activations import PipelineBroken

from .conftest import TOKEN

pytestmark = pytest.mark.integration  # real swarms: seconds

T = Timeouts(connect=2.0, part=3.0, grace=0.5, round=15.0, heartbeat=0.5, eviction=3.0)
SHAPE = (2, 3, 4)


def _swarm(url, pid):
    return Swarm(url, run_id="pipe", token=TOKEN, listen="127.0.0.1:0", timeouts=T, peer_id=pid)


def _msg(x: np.ndarray, codec: str = "fp32") -> bytes:
    return encode({"x": x}, codec=codec)


@pytest.mark.timeout(60)
def test_activation_link_delivers_checks_and_times_out(cluster):
    url = cluster.rendezvous()
    a, b = _swarm(url, "a"), _swarm(url, "b")
    la, lb = a.activation_link(), b.activation_link()
    with a, b:
        c = _swarm(url, "c")
        with c, pytest.raises(RuntimeError):
            c.activation_link()  # too late: the server's routes are fixed once it started
        x = np.arange(24, dtype=np.float32).reshape(SHAPE)
        # b does not expect anything from a yet: the send is retried (409) until b does
        fut = la.send(b.address, "b", "act", 7, _msg(x), timeout=10)
        time.sleep(0.3)
        assert not fut.done(), "a send to a receiver that does not expect it must be retried, not dropped"
        lb.expect("act", "a", SHAPE, "fp32")
        assert fut.result(10) > 0
        got = lb.take("act", 7, timeout=5)
        np.testing.assert_array_equal(got, x)
        assert la.stats.messages_sent == 1 and lb.stats.messages_received == 1 and la.stats.retries >= 1
        assert la.stats.bytes_sent == lb.stats.bytes_received == len(_msg(x))
        # the same message again (a retry whose answer was lost) is answered, not stored twice
        assert la.send(b.address, "b", "act", 7, _msg(x), timeout=10).result(10) > 0
        assert lb.stats.messages_received == 1
        with pytest.raises(PipelineBroken):
            lb.take("act", 7, timeout=0.3)
        # a message computed in an older epoch than the sender's link is dropped before sending
        assert la.send(b.address, "b", "act", 11, _msg(x), timeout=10, epoch=-1).result(10) == 0
        # lossy codec: what arrives is the codec's decode
        lb.expect("grad", "a", SHAPE, "int8")
        la.send(b.address, "b", "grad", 7, _msg(x, "int8"), timeout=10).result(10)
        got = lb.take("grad", 7, timeout=5)
        assert np.abs(got - x).max() <= np.abs(x).max() / 127 + 1e-6, np.abs(got - x).max()
        # nothing arrives: the deadline names the expected sender
        t0 = time.monotonic()
        with pytest.raises(PipelineBroken) as e:
            lb.take("act", 8, timeout=0.5)
        assert 0.45 <= time.monotonic() - t0 < 3 and e.value.neighbour == "a" and "micro-batch 8" in str(e.value)
        # another body for a micro-batch already delivered is a conflict: retried, then a failure
        with pytest.raises(PipelineBroken):
            la.send(b.address, "b", "act", 7, _msg(x + 1), timeout=0.5).result(10)
        la.set_epoch(0)  # clears the recorded failure
        # a wrong shape is refused for good: the sender's link records the failure
        la.send(b.address, "b", "act", 9, _msg(np.zeros((2, 3, 5), np.float32)), timeout=10)
        with pytest.raises(PipelineBroken) as e:
            la.take("grad", 0, timeout=10)
        assert "refused" in str(e.value) and "400" in str(e.value), str(e.value)
        # a message of an older epoch is dropped quietly (410)
        la.set_epoch(0)
        lb.set_epoch(1)
        assert la.send(b.address, "b", "act", 10, _msg(x), timeout=10).result(10) == 0
        assert la.failure is None
