"""The char-LM example's peers (``examples/char_lm/main.py --json-events``) as real processes on
the shared cluster (``tests/_cluster.py``): a real rendezvous process on 127.0.0.1."""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path

import pytest
from _cluster import Cluster, Proc, cluster_of

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "char_lm" / "main.py"
TINY = [
    "--log-level", "DEBUG", "--d-model", "32", "--layers", "1", "--heads", "2", "--seq-len", "32",
    "--batch-size", "4", "--eval-batches", "1", "--lr", "1e-2", "--log-every", "1", "--schedule-steps", "200",
]  # fmt: skip


class ExampleCluster(Cluster):
    """``procs[name]``: the peer started as ``name``; each writes ``tmp/NAME.json`` at its end."""

    reap_signal = signal.SIGKILL  # a peer still running when the test ends is killed

    def __init__(self, tmp: Path):
        super().__init__(tmp, token="e2e-test-token")
        # a small real text (standard-library source) keeps each peer's start-up short
        import sysconfig

        stdlib = Path(sysconfig.get_paths()["stdlib"])
        text = b"".join(sorted(stdlib.glob("*.py"))[i].read_bytes() for i in range(0, 40))
        self.text_file = tmp / "text.txt"
        self.text_file.write_bytes(text)
        self.token_file = tmp / "token"
        self.token_file.write_text(self.token)
        self.rendezvous(heartbeat=0.5, eviction=6, extra=("--token-file", str(self.token_file)))

    def start_peer(self, name: str, *extra: str, peer_id: str | None = None, data_seed: int | None = None) -> Proc:
        """Starts a peer; ``name`` names its output files (and is its id unless ``peer_id``)."""
        peers = [n for n in self.procs if not n.startswith("rendezvous")]
        seed = len(peers) if data_seed is None else data_seed
        cmd = [sys.executable, str(EXAMPLE), "--rendezvous", self.url, "--run-id", "e2e"]
        cmd += ["--token-file", str(self.token_file), "--peer-id", peer_id or name, "--data-seed", str(seed)]
        cmd += ["--listen", "127.0.0.1:0", "--json-events", "--summary-json", str(self.tmp / f"{name}.json")]
        cmd += ["--text", str(self.text_file), *TINY, *extra]
        return self.spawn(name, cmd, env={"XLA_FLAGS": "--xla_cpu_multi_thread_eigen=false"})

    def result(self, name: str, timeout: float) -> dict:
        p = self.procs[name]
        code = p.wait(timeout)
        assert code == 0, f"{name} exited {code}: {p.stderr()}"
        return json.loads((self.tmp / f"{name}.json").read_text())["peer_result"]


@pytest.fixture
def cluster(tmp_path):
    with cluster_of(ExampleCluster(tmp_path)) as c:
        yield c


def digests_by_step(r: dict) -> dict[int, str]:
    """Global-state digest after each completed round, by the step the round started at."""
    return {m["step"]: m["state_digest"] for m in r["round_log"] if m["ok"]}
