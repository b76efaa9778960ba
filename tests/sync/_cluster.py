"""Real peer processes of the char-LM example on 127.0.0.1 with a real rendezvous process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "char_lm" / "main.py"
TINY = [
    "--log-level",
    "DEBUG",
    "--d-model",
    "32",
    "--layers",
    "1",
    "--heads",
    "2",
    "--seq-len",
    "32",
    "--batch-size",
    "4",
    "--eval-batches",
    "1",
    "--lr",
    "1e-2",
    "--log-every",
    "1",
    "--schedule-steps",
    "200",
]


class Cluster:
    def __init__(self, tmp: Path):
        self.tmp = tmp
        self.procs: dict[str, subprocess.Popen] = {}
        self.files: list = []
        # a small real text (standard-library source) keeps each peer's start-up short
        import sysconfig

        stdlib = Path(sysconfig.get_paths()["stdlib"])
        text = b"".join(sorted(stdlib.glob("*.py"))[i].read_bytes() for i in range(0, 40))
        self.text_file = tmp / "text.txt"
        self.text_file.write_bytes(text)
        self.token_file = tmp / "token"
        self.token_file.write_text("e2e-test-token")
        port_file = tmp / "port"
        self.rendezvous = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "ravnest_jax.cli",
                "rendezvous",
                "--host",
                "127.0.0.1",
                "--port",
                "0",
                "--port-file",
                str(port_file),
                "--token-file",
                str(self.token_file),
                "--heartbeat",
                "0.5",
                "--eviction",
                "6",
            ],
            stdout=subprocess.DEVNULL,
            stderr=self._open(tmp / "rendezvous.log"),
        )
        deadline = time.monotonic() + 30
        while not port_file.exists():
            assert self.rendezvous.poll() is None and time.monotonic() < deadline, "rendezvous did not start"
            time.sleep(0.05)
        self.url = f"http://127.0.0.1:{port_file.read_text().strip()}"

    def _open(self, path: Path):
        f = open(path, "w")
        self.files.append(f)
        return f

    def start_peer(
        self, name: str, *extra: str, peer_id: str | None = None, data_seed: int | None = None
    ) -> subprocess.Popen:
        """Starts a peer; ``name`` names its output files (and is its id unless ``peer_id``)."""
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "XLA_FLAGS": "--xla_cpu_multi_thread_eigen=false"}
        seed = len(self.procs) if data_seed is None else data_seed
        cmd = [
            sys.executable,
            str(EXAMPLE),
            "--rendezvous",
            self.url,
            "--run-id",
            "e2e",
            "--token-file",
            str(self.token_file),
            "--peer-id",
            peer_id or name,
            "--data-seed",
            str(seed),
            "--listen",
            "127.0.0.1:0",
            "--json-events",
            "--summary-json",
            str(self.tmp / f"{name}.json"),
            "--text",
            str(self.text_file),
            *TINY,
            *extra,
        ]
        p = subprocess.Popen(
            cmd, stdout=self._open(self.tmp / f"{name}.out"), stderr=self._open(self.tmp / f"{name}.log"), env=env
        )
        self.procs[name] = p
        return p

    def events(self, name: str) -> list[dict]:
        out = []
        for line in (self.tmp / f"{name}.out").read_text().splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                pass
        return out

    def wait_event(self, name: str, pred, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for ev in self.events(name):
                if pred(ev):
                    return ev
            assert self.procs[name].poll() is None, f"{name} exited: {(self.tmp / f'{name}.log').read_text()[-3000:]}"
            time.sleep(0.1)
        raise AssertionError(f"{name}: no matching event in {timeout} s")

    def result(self, name: str, timeout: float) -> dict:
        p = self.procs[name]
        try:
            code = p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{name} hangs: {(self.tmp / f'{name}.log').read_text()[-3000:]}") from None
        assert code == 0, f"{name} exited {code}: {(self.tmp / f'{name}.log').read_text()[-3000:]}"
        return json.loads((self.tmp / f"{name}.json").read_text())["peer_result"]

    def close(self) -> None:
        for p in [*self.procs.values(), self.rendezvous]:
            if p.poll() is None:
                p.kill()
            p.wait(timeout=30)
        for f in self.files:
            f.close()


@pytest.fixture
def cluster(tmp_path):
    c = Cluster(tmp_path)
    try:
        yield c
    finally:
        c.close()
        for p in c.procs.values():
            assert p.poll() is not None  # nothing left running


def digests_by_step(r: dict) -> dict[int, str]:
    """Global-state digest after each completed round, by the step the round started at."""
    return {m["step"]: m["state_digest"] for m in r["round_log"] if m["ok"]}
