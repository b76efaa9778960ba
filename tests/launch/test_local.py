"""``ravnest-jax local``: a rendezvous and N peer processes of a user script on 127.0.0.1."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration  # real processes

ROOT = Path(__file__).resolve().parents[2]
LAUNCH = [sys.executable, "-m", "ravnest_jax.cli", "local"]


def _run(args: list[str], timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run([*LAUNCH, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def _results(stdout: str) -> dict[str, dict]:
    """The last JSON line (its ``"result"`` if it has one) each peer printed, prefixed
    ``[peerN] `` by the launcher; round events are skipped."""
    out = {}
    for line in stdout.splitlines():
        name, _, rest = line.partition("] ")
        if name.startswith("[peer") and rest.startswith("{") and '"event": "round"' not in rest:
            d = json.loads(rest)
            out[name[1:]] = d.get("result", d)
    return out


def _children(run_id: str) -> list[int]:
    """Live processes started for ``run_id`` (their environment names it)."""
    pids = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            env = (d / "environ").read_bytes()
            state = (d / "stat").read_text().split(") ")[1][0]
        except OSError:
            continue
        if f"RAVNEST_RUN_ID={run_id}".encode() in env.split(b"\0") and state != "Z":
            pids.append(int(d.name))
    return pids


@pytest.mark.timeout(300)
def test_the_docs_user_script_runs_on_three_peers(tmp_path):
    summary = tmp_path / "s.json"
    r = _run(
        [
            "--peers",
            "3",
            "--no-progress",
            "--summary-json",
            str(summary),
            "--",
            "python",
            "examples/quickstart_peer.py",
            "--steps",
            "60",
        ]
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    s = json.loads(summary.read_text())
    assert set(s["peers"]) == {"peer0", "peer1", "peer2"}, s
    got = {n: p["summary"] for n, p in s["peers"].items()}
    assert all(p["exit"] == 0 for p in s["peers"].values()), s
    assert all(g["rounds"] == 3 and g["failed_rounds"] == 0 for g in got.values()), got
    assert len({g["last_state_digest"] for g in got.values()}) == 1, got
    assert "global state: identical on every peer" in r.stdout, r.stdout[-2000:]
    res = _results(r.stdout)
    assert len({round(v["eval_loss"], 6) for v in res.values()}) == 1, res  # one global model


@pytest.mark.timeout(300)
def test_the_char_lm_peer_script_runs_on_three_peers():
    """The issue's command: ``ravnest-jax local --peers 3 -- python examples/char_lm/train.py
    --max-steps 60``: 3 rounds on every peer, one global model whose eval loss fell."""
    r = _run(["--peers", "3", "--no-progress", "--", "python", "examples/char_lm/train.py", "--max-steps", "60"])
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = _results(r.stdout)
    assert set(res) == {"peer0", "peer1", "peer2"}, r.stdout[-3000:]
    for v in res.values():
        assert v["how"] == "fresh" and v["steps"] == 60 and v["rounds"] == 3 and v["failed_rounds"] == 0, v
        assert v["eval_loss_end"] < v["eval_loss_start"] - 1.0, v
    assert len({v["last_state_digest"] for v in res.values()}) == 1, res
    assert len({v["eval_loss_end"] for v in res.values()}) == 1, res  # one global model
    assert "global state: identical on every peer" in r.stdout, r.stdout[-2000:]


@pytest.mark.timeout(400)
def test_an_nnx_model_trains_across_two_peers_and_resumes(tmp_path):
    ckpt = tmp_path / "ckpt"
    cmd = ["--peers", "2", "--no-progress", "--", "python", "examples/nnx_peer.py", "--checkpoint-dir", str(ckpt)]
    r = _run([*cmd, "--steps", "60"])
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    first = _results(r.stdout)
    assert set(first) == {"peer0", "peer1"}, r.stdout[-3000:]
    for v in first.values():
        assert v["how"] == "fresh" and v["rounds"] == 3 and v["failed_rounds"] == 0, v
        assert v["eval_loss_end"] < v["eval_loss_start"] - 1.0, v
    assert len({v["digest"] for v in first.values()}) == 1, first
    assert "60" in os.listdir(ckpt / "peer0"), os.listdir(ckpt / "peer0")  # the end state is saved
    # both peers stopped; started again with more steps: the launcher's peers wait for each
    # other (min_peers = RAVNEST_WORLD_SIZE) and restart together from their common checkpoint
    r = _run([*cmd, "--steps", "100"])
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    second = _results(r.stdout)
    for v in second.values():
        assert v["how"] == "restarted" and v["start_step"] == 60, v
        assert v["end_step"] == 100 and v["failed_rounds"] == 0, v
        assert v["eval_loss_start"] == pytest.approx(first["peer0"]["eval_loss_end"], rel=1e-6), (v, first)
        assert v["eval_loss_end"] < v["eval_loss_start"], v
    assert len({v["digest"] for v in second.values()}) == 1, second


@pytest.mark.timeout(60)
def test_a_missing_script_is_one_line_before_anything_starts(tmp_path):
    t0 = time.monotonic()
    r = _run(["--peers", "2", "--", "python", str(tmp_path / "nope.py")], timeout=30)
    assert r.returncode != 0
    assert r.stderr.strip().splitlines() == [f"error: {tmp_path / 'nope.py'}: no such file"], r.stderr
    assert time.monotonic() - t0 < 20
    r = _run(["--peers", "2"], timeout=30)
    assert r.returncode != 0 and "no command" in r.stderr, r.stderr


@pytest.mark.timeout(120)
def test_a_peer_that_refuses_its_input_stops_the_others(tmp_path):
    """Exit status 2 (bad input, its one error line): the other peers would wait for it (a
    fine-tuning peer waits for the run's peer count, 300 s), so the launcher stops them."""
    script = tmp_path / "peer.py"
    script.write_text(
        "import os, sys, time\n"
        "if os.environ['RAVNEST_RANK'] == '0':\n"
        "    print('error: bad input', file=sys.stderr)\n"
        "    sys.exit(2)\n"
        "time.sleep(100)\n"
    )
    t0 = time.monotonic()
    r = _run(["--peers", "3", "--no-progress", "--", "python", str(script)], timeout=90)
    took = time.monotonic() - t0
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert "peer0 refused its input (exit status 2): stopping the other peers" in r.stderr, r.stderr
    assert took < 60, (took, r.stderr)  # not the 100 s the others would sleep


@pytest.mark.timeout(120)
def test_peers_get_their_environment_and_a_dying_peer_is_reported(tmp_path):
    script = tmp_path / "peer.py"
    script.write_text(
        "import json, os, sys\n"
        "print(json.dumps({k: v for k, v in os.environ.items() if k.startswith('RAVNEST_')}))\n"
        "sys.exit(3 if os.environ['RAVNEST_RANK'] == '1' else 0)\n"
    )
    r = _run(
        ["--peers", "2", "--no-progress", "--codec", "int8", "--run-id", "envtest", "--", "python", str(script)],
        timeout=60,
    )
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert "peer1 exited with status 3" in r.stderr, r.stderr
    envs = {}
    for line in r.stdout.splitlines():
        name, _, rest = line.partition("] ")
        if rest.startswith("{"):
            envs[name[1:]] = json.loads(rest)
    assert set(envs) == {"peer0", "peer1"}, r.stdout
    for i, (name, env) in enumerate(sorted(envs.items())):
        assert env["RAVNEST_PEER_ID"] == name and env["RAVNEST_RANK"] == str(i), env
        assert env["RAVNEST_RUN_ID"] == "envtest" and env["RAVNEST_CODEC"] == "int8", env
        assert env["RAVNEST_WORLD_SIZE"] == "2" and env["RAVNEST_LISTEN"] == "127.0.0.1:0", env
        assert env["RAVNEST_RENDEZVOUS"].startswith("http://127.0.0.1:"), env
        assert len(env["RAVNEST_TOKEN"]) == 32, env


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["SIGINT", "SIGKILL"])
def test_stopping_the_launcher_leaves_no_process(tmp_path, how):
    """Ctrl+C (SIGINT) stops the peers and exits 130 within seconds; a SIGKILLed launcher takes
    its peers and its rendezvous with it (PR_SET_PDEATHSIG, --exit-with-parent)."""
    script = tmp_path / "peer.py"
    script.write_text("import time\nprint('up', flush=True)\ntime.sleep(600)\n")
    run_id = f"stop-{os.getpid()}-{how}"
    # started with SIGINT ignored, as a background job of a script is (and as this test process
    # may be, after other tests): the launcher and its peers must still stop on SIGINT
    p = subprocess.Popen(
        # (sh ignores SIGINT and execs: no preexec_fn, which forks this jax process in Python)
        [
            "sh",
            "-c",
            "trap '' INT; exec \"$@\"",
            "sh",
            *LAUNCH,
            "--peers",
            "2",
            "--no-progress",
            "--run-id",
            run_id,
            "--",
            "python",
            str(script),
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        up = set()
        deadline = time.monotonic() + 60
        while len(up) < 2:
            line = p.stdout.readline()
            assert line and time.monotonic() < deadline, f"peers did not start: {p.stderr.read()}"
            if line.strip().endswith("] up"):
                up.add(line.split("]")[0])
        assert len(_children(run_id)) == 3, _children(run_id)  # the rendezvous and 2 peers
        t0 = time.monotonic()
        p.send_signal(getattr(signal, how))
        # the launcher's own bound: 30 s for the peers, 10 s for the rendezvous, 5 s for its
        # readers (an idle machine: about 1 s)
        rc = p.wait(timeout=90)
        if how == "SIGINT":
            assert rc == 130 and time.monotonic() - t0 < 50, (rc, time.monotonic() - t0)
        deadline = time.monotonic() + 20
        while _children(run_id) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _children(run_id) == [], "processes left behind"
    finally:
        if p.poll() is None:
            p.kill()
        for pid in _children(run_id):
            os.kill(pid, signal.SIGKILL)
        p.wait()
        p.stdout.close()
        p.stderr.close()
