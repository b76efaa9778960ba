"""The char-LM example's ``--adversary`` peer really sends what it says, through the call
OuterSync makes (``sync._pipeline.exchange`` with the device-encoded contribution), over a
real rendezvous and real swarm peers on 127.0.0.1 (in this process)."""

from __future__ import annotations

import concurrent.futures
import contextlib
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT))

from char_lm.peer import _adversary_swarm  # noqa: E402
from ravnest_jax import compress  # noqa: E402
from ravnest_jax.swarm import AllReduce, Swarm  # noqa: E402
from ravnest_jax.sync._pipeline import exchange  # noqa: E402
from tests.sync._local import FAST, TOKEN, rendezvous_thread  # noqa: E402


@pytest.mark.parametrize("codec", ["fp32", "int8"])
def test_a_scaling_adversary_moves_the_plain_mean(codec):
    n = 4096
    honest = np.full(n, 1.0, np.float32)
    with rendezvous_thread(FAST) as url, contextlib.ExitStack() as stack:
        kw = dict(run_id="adv", token=TOKEN, codec=codec, listen="127.0.0.1:0", timeouts=FAST)
        kw["algorithm"] = AllReduce(aggregator="mean")
        a = stack.enter_context(Swarm(url, peer_id="p0", **kw))
        b = stack.enter_context(_adversary_swarm("scale:1000")(url, peer_id="p1", **kw))
        a.wait_for_peers(2, timeout=20)
        packed = compress.device_encode([jnp.asarray(honest)], codec)[0]  # as OuterSync: a list of leaves
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            futs = [pool.submit(exchange, s, packed, 1.0, None, None, lambda r, ran: None) for s in (a, b)]
            (mean_a, rec_a, *_), (mean_b, rec_b, *_) = (f.result(timeout=60) for f in futs)
    assert rec_a.digest == rec_b.digest and sorted(rec_a.contributors) == ["p0", "p1"], (rec_a, rec_b)
    # (1 + 1000) / 2: the adversary's contribution is its pseudo-gradient times 1000
    np.testing.assert_allclose(mean_a, 500.5, rtol=2e-2, err_msg=f"mean {mean_a[:4]}")
