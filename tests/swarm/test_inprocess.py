"""Swarm objects in the test process (against a rendezvous process): the Python API surface."""

from __future__ import annotations

import concurrent.futures

import numpy as np
import pytest

import ravnest_jax as rj
from ravnest_jax.swarm import RoundFailed, Swarm, SwarmError, Timeouts

from .conftest import TOKEN

pytestmark = pytest.mark.integration  # real swarms (processes or threads): minutes in all

T = Timeouts(connect=2.0, part=3.0, grace=0.5, round=15.0, heartbeat=0.5, eviction=3.0)


def _swarm(url, pid, **kw):
    return Swarm(url, run_id="inproc", token=TOKEN, listen="127.0.0.1:0", timeouts=T, peer_id=pid, **kw)


@pytest.mark.timeout(60)
def test_two_swarms_in_one_process(cluster):
    url = cluster.rendezvous()
    with _swarm(url, "a") as a, _swarm(url, "b") as b:
        assert rj.Swarm is Swarm
        peers = a.wait_for_peers(2, timeout=10)
        assert [p.peer_id for p in peers] == ["a", "b"]
        assert all(p.address.startswith("http://127.0.0.1:") for p in peers)
        ta = {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.float32(1.0)}
        tb = {"w": np.ones((2, 3), np.float32), "b": np.float32(3.0)}
        fa = a.all_reduce_async(ta, weight=1.0)
        fb = b.all_reduce_async(tb, weight=3.0)
        assert isinstance(fa, concurrent.futures.Future)
        (ra, reca), (rb, recb) = fa.result(20), fb.result(20)
        exp = (np.arange(6, dtype=np.float64).reshape(2, 3) + 3.0) / 4.0
        np.testing.assert_allclose(ra["w"], exp, rtol=1e-6)
        np.testing.assert_array_equal(rb["w"], ra["w"])  # both got the same mean
        assert ra["w"].shape == (2, 3) and ra["w"].dtype == np.float32
        assert float(ra["b"]) == pytest.approx(2.5)
        assert reca.ok and reca.digest == recb.digest and reca.contributors == ("a", "b")
        assert reca.total_weight == 4.0 and reca.round == 0 and reca.bytes_sent > 0
        assert reca.bytes_received > 0 and reca.seconds > 0
        # bad inputs are refused up front
        with pytest.raises(TypeError):
            a.all_reduce_async({"w": np.zeros(3, np.float64)})
        with pytest.raises(ValueError):
            a.all_reduce_async({"w": np.zeros(3, np.float32)}, weight=0.0)
        with pytest.raises(ValueError):
            a.all_reduce_async({"w": np.full(3, np.nan, np.float32)})
    # b left: a single peer averages with itself
    with _swarm(url, "solo") as s:
        out, rec = s.all_reduce({"x": np.full(4, 2.0, np.float32)}, weight=5.0)
        assert rec.ok and rec.contributors == ("solo",) and out["x"].tolist() == [2.0] * 4


@pytest.mark.timeout(60)
def test_round_fails_cleanly_when_rendezvous_is_gone(cluster):
    url = cluster.rendezvous()
    t = Timeouts(connect=0.5, part=1.0, grace=0.2, round=2.0, heartbeat=0.3, eviction=2.0)
    with Swarm(url, run_id="gone", token=TOKEN, listen="127.0.0.1:0", timeouts=t) as s:
        cluster.rv.kill9()
        with pytest.raises(RoundFailed) as e:
            s.all_reduce({"x": np.ones(3, np.float32)})
        assert e.value.record.ok is False and "deadline" in e.value.record.error
        with pytest.raises(SwarmError):
            s.peers()


@pytest.mark.timeout(60)
def test_a_second_process_with_a_live_peers_id_is_refused(cluster):
    """Two live processes under one peer id (a copied checkpoint directory, a reused
    --peer-id): the second is refused in one line; the first goes on; once the first left, the
    id is free again (a restart)."""
    url = cluster.rendezvous()
    with _swarm(url, "a") as a:
        with pytest.raises(SwarmError) as e:
            _swarm(url, "a").start()
        assert "peer id 'a' is in use by a live peer at " + a.address in str(e.value), str(e.value)
        assert [p.peer_id for p in a.peers()] == ["a"]
        cluster.rv.expect_log("refused a second process as a", 10)
    with _swarm(url, "a") as again:  # the first one left: a restart
        assert [p.peer_id for p in again.peers()] == ["a"]


def test_bad_arguments():
    with pytest.raises(ValueError):
        Swarm("http://127.0.0.1:1", run_id="r", token="", listen="127.0.0.1:0")
    with pytest.raises(ValueError):
        Swarm("http://127.0.0.1:1", run_id="r", token="t", codec="nope")
    with pytest.raises(ValueError):
        Swarm("http://127.0.0.1:1", run_id="r", token="t", listen="nonsense")


@pytest.mark.timeout(30)
def test_unreachable_rendezvous_raises_swarm_error():
    t = Timeouts(connect=0.3, part=0.5, grace=0.1, round=2.0, heartbeat=0.3, eviction=1.0)
    with pytest.raises(SwarmError):
        with Swarm("http://127.0.0.1:9", run_id="r", token="t", listen="127.0.0.1:0", timeouts=t):
            pass


@pytest.mark.timeout(60)
def test_tls_between_peers_and_to_the_rendezvous(cluster, tmp_path):
    import shutil
    import ssl
    import subprocess

    if shutil.which("openssl") is None:
        pytest.skip("openssl not available to make a test certificate")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            str(key),
            "-out",
            str(cert),
            "-days",
            "1",
            "-subj",
            "/CN=127.0.0.1",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )
    url = cluster.rendezvous(extra=("--certfile", str(cert), "--keyfile", str(key)), scheme="https")
    server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server.load_cert_chain(cert, key)
    client = ssl.create_default_context(cafile=str(cert))
    tls = dict(tls=rj.TLS(server=server, client=client), algorithm=rj.AllReduce(aggregator="mean"))  # exact mean
    with _swarm(url, "a", **tls) as a, _swarm(url, "b", **tls) as b:
        assert a.address.startswith("https://127.0.0.1:")
        a.wait_for_peers(2, timeout=10)
        fa = a.all_reduce_async({"x": np.full(5, 1.0, np.float32)}, weight=1.0)
        fb = b.all_reduce_async({"x": np.full(5, 3.0, np.float32)}, weight=1.0)
        (ra, reca), (rb, recb) = fa.result(20), fb.result(20)
        assert ra["x"].tolist() == rb["x"].tolist() == [2.0] * 5 and reca.digest == recb.digest
    # a client that does not trust the certificate cannot even join
    with pytest.raises(SwarmError):
        with Swarm(
            url,
            run_id="inproc",
            token=TOKEN,
            listen="127.0.0.1:0",
            timeouts=Timeouts(connect=0.5, part=0.5, grace=0.1, round=2.0, heartbeat=0.3, eviction=1.0),
        ):
            pass


@pytest.mark.timeout(60)
def test_a_new_process_that_begins_its_round_late_is_not_dropped(cluster):
    """A fresh Swarm (a restarted process) learns the swarm's round number from its own begin.
    After a whole-swarm restart a member that begins first pushes its part at once; the other
    new process's server must hold that part until its own begin answers, not refuse it as a
    round it does not know (which made the others drop it as unreachable: a lost round and a
    resync after every whole-swarm restart)."""
    import time

    url = cluster.rendezvous()
    x = {"x": np.ones(1024, np.float32)}
    with _swarm(url, "a", algorithm=rj.AllReduce(aggregator="mean")) as a:
        for _ in range(4):  # the run is at round 3 or later: far ahead of a new process's -1
            assert a.all_reduce(x)[1].ok
    # (the plain mean: the clipped one would scale b's 3x larger part down to twice a's)
    with (
        _swarm(url, "a", algorithm=rj.AllReduce(aggregator="mean")) as a,
        _swarm(url, "b", algorithm=rj.AllReduce(aggregator="mean")) as b,
    ):  # restarted
        a.wait_for_peers(2, timeout=10)
        fa = a.all_reduce_async({"x": np.full(1024, 1.0, np.float32)})
        time.sleep(1.0)  # a is in the round and has pushed b's part before b begins
        fb = b.all_reduce_async({"x": np.full(1024, 3.0, np.float32)})
        (ra, reca), (rb, recb) = fa.result(20), fb.result(20)
        np.testing.assert_array_equal(ra["x"], rb["x"])
        # one attempt: b's part was not refused (before, b was voted unreachable: a retry)
        assert reca.round == recb.round and reca.attempts == recb.attempts == 1, (reca, recb)
        assert reca.contributors == recb.contributors == ("a", "b")
        np.testing.assert_allclose(rb["x"], 2.0)


@pytest.mark.timeout(90)
def test_a_joining_process_costs_the_running_swarm_no_deadline(cluster):
    """A process that joins a run with rounds behind it (downloading state, say) is on standby:
    rounds created before it first asks leave it out, so the others do not wait out a part
    deadline for it; its first ask puts it in the next round. When a whole swarm comes back
    (every process new), the first round has all of them."""
    import time

    url = cluster.rendezvous()
    x = {"x": np.ones(256, np.float32)}
    with _swarm(url, "a") as a, _swarm(url, "b") as b:
        a.wait_for_peers(2, timeout=10)
        ra, rb = a.all_reduce_async(x), b.all_reduce_async(x)
        assert ra.result(20)[1].group == ("a", "b") and rb.result(20)[1].ok
        with _swarm(url, "c") as c:
            a.wait_for_peers(3, timeout=10)
            standby = {p["peer_id"]: p["standby"] for p in a.status()["peers"]}
            assert standby == {"a": False, "b": False, "c": True}, standby
            t0 = time.monotonic()
            ra, rb = a.all_reduce_async(x), b.all_reduce_async(x)
            reca, recb = ra.result(20)[1], rb.result(20)[1]
            assert reca.ok and reca.group == ("a", "b") and reca.attempts == 1, reca
            assert recb.ok and recb.group == reca.group, recb
            assert time.monotonic() - t0 < T.part, "the others waited for the joining process"
            # c asks now: it waits for the next round the rendezvous creates (one created
            # ahead at the last commit may still leave it out), and is in it with the others
            fc = c.all_reduce_async(x)
            for _ in range(4):
                ra, rb = a.all_reduce_async(x), b.all_reduce_async(x)
                reca = ra.result(20)[1]
                rb.result(20)
                if len(reca.group) == 3:
                    break
            recc = fc.result(20)[1]
            assert recc.ok and recc.group == reca.group == ("a", "b", "c") and reca.attempts == 1, (reca, recc)
    # the whole swarm comes back: three new processes, the run's rounds behind them
    with _swarm(url, "a") as a, _swarm(url, "b") as b, _swarm(url, "c") as c:
        a.wait_for_peers(3, timeout=10)
        fs = [s.all_reduce_async(x) for s in (a, b, c)]
        recs = [f.result(20)[1] for f in fs]
        assert all(r.ok and r.group == ("a", "b", "c") and r.attempts == 1 for r in recs), recs


@pytest.mark.timeout(60)
def test_a_restarted_lone_process_runs_in_the_round_after_one_that_failed_for_everybody(cluster, caplog):
    """A lone peer's process stops after the rendezvous created its next round (handed out with
    the last commit); that round fails for everybody. The restarted process (same id) expects
    it: it missed nothing, so its contribution runs in the next round, instead of abstaining
    and reporting a failed round. Had a round since committed, it goes on from its own state all
    the same: it is the round's only member."""
    url = cluster.rendezvous()
    x = {"x": np.full(64, 2.0, np.float32)}
    with _swarm(url, "lone", algorithm=rj.AllReduce(aggregator="mean")) as a:
        assert [a.all_reduce(x)[1].round for _ in range(2)] == [0, 1]
    with _swarm(url, "lone", algorithm=rj.AllReduce(aggregator="mean")) as b:
        outcomes = {r["round"]: r["outcome"] for r in b.status()["rounds"]}
        assert outcomes.get(2) == "failed", outcomes  # created ahead for the first process
        with caplog.at_level("WARNING", logger="ravnest_jax.swarm"):
            out, rec = b.all_reduce_async(x, round=2).result(20)
        assert rec.ok and rec.round == 3 and rec.contributors == ("lone",), rec
        np.testing.assert_array_equal(out["x"], x["x"])
        assert "ran without this peer" not in caplog.text, caplog.text  # round 2 failed for everybody: nothing lost
        # round 3 committed, but this peer is the only member of the round it is handed (4): no
        # other peer holds a newer state, so its own is the run's and it contributes (a lone peer
        # restarted from an older checkpoint goes on from it instead of reporting a failed round)
        with caplog.at_level("WARNING", logger="ravnest_jax.swarm"):
            out, rec = b.all_reduce_async(x, round=3).result(20)
        assert rec.ok and rec.round == 4 and rec.contributors == ("lone",), rec
        assert "lone: rounds 3 to 3 ran without this peer (it resumed from an older state)" in caplog.text, caplog.text
