"""Real-process fixtures of the pipeline tests: the shared cluster (``tests/_cluster.py``) with
stage peer scripts as its peers, all reaped; no child process or bound port may be left behind."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from _cluster import Cluster, Proc, cluster_of

HERE = Path(__file__).parent
TOKEN = "pipeline-test-token"


class PipeCluster(Cluster):
    def start(self, name: str, script: Path, *args: str) -> Proc:
        """A stage peer: ``script --url URL --token TOKEN ARGS``."""
        return self.spawn(name, [sys.executable, str(script), "--url", self.url, "--token", self.token, *args])


@pytest.fixture
def pipe_cluster(tmp_path: Path):
    with cluster_of(PipeCluster(tmp_path, token=TOKEN)) as c:
        yield c
