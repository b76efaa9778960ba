"""Real-process fixtures for swarm tests: the shared cluster (``tests/_cluster.py``) with the swarm
worker (``_worker.py``) as its peer, all reaped."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from _cluster import TOKEN, Proc, cluster_of, port_is_free
from _cluster import Cluster as _Cluster

__all__ = ["TOKEN", "Cluster", "Proc", "port_is_free"]

HERE = Path(__file__).parent
WORKER = HERE / "_worker.py"


class Cluster(_Cluster):
    dump_on_reap = True  # a failed swarm test shows where each peer was
    rendezvous_flags = ("--verbose",)

    def peer(self, peer_id: str, seed: int, wrap: tuple[str, ...] = (), **kw: object) -> Proc:
        """A swarm worker: ``kw`` become its flags (``round_sleep=0.05``: ``--round-sleep 0.05``;
        True: a switch)."""
        args = [*wrap, sys.executable, str(WORKER), "--url", self.url, "--token", str(kw.pop("token", TOKEN))]
        args += ["--peer-id", peer_id, "--seed", str(seed)]
        kw.setdefault("out_dir", str(self.tmp))
        for k, v in kw.items():
            if v is True:  # a switch
                args.append(f"--{k.replace('_', '-')}")
            elif v is not False:
                args += [f"--{k.replace('_', '-')}", str(v)]
        return self.spawn(peer_id, args)


@pytest.fixture
def cluster(tmp_path: Path):
    with cluster_of(Cluster(tmp_path)) as c:
        yield c
