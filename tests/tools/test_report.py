"""``ravnest-jax report SUMMARY.json``: three PNGs with content from a run's round logs, and one
line naming a summary it cannot plot."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json

import numpy as np
import pytest

from ravnest_jax.cli import main
from ravnest_jax.swarm import RoundRecord
from ravnest_jax.sync._metrics import round_metrics


def _Record(r: int, sent: int) -> RoundRecord:  # noqa: N802 - what the swarm returns for an ok round
    return RoundRecord(
        round=r, ok=True, attempts=1, group=("a", "b"), contributors=("a", "b"), total_weight=2.0,
        bytes_sent=sent, bytes_received=sent, seconds=0.3, digest=f"d{r}", codec="int4",
    )  # fmt: skip


def _summary(tmp_path):
    peers = []
    for i, name in enumerate(("peer0", "peer1")):
        log = []
        for r in range(6):
            m = round_metrics(
                r, 0, 10 * (r + 1), 10 * (r + 1) + 1, 0.3, 0.05 * i, 0.97 - 0.01 * r,
                record=_Record(r, 40_000 + 100 * i), payload_bytes=40_000, float_bytes=320_000, state_digest=f"s{r}",
            )  # fmt: skip
            log.append({**dataclasses.asdict(m), "train_loss": 3.0 - 0.2 * r + 0.05 * i})
        log.append({**dataclasses.asdict(round_metrics(6, 0, 70, 71, 5.0, 0.0, 0.0, error="RoundFailed: x"))})
        peers.append({"peer": name, "params": 80_000, "round_log": log})
    path = tmp_path / "summary.json"
    path.write_text(json.dumps({"peers": peers, "data_parallel_bytes_per_peer": 1e9}))
    return path


class _Done:
    def __init__(self, returncode, stdout, stderr):
        self.returncode, self.stdout, self.stderr = returncode, stdout, stderr


def _cli(*args):
    """``ravnest-jax report ARGS`` in this process (what the console script runs)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(["report", *args])
    return _Done(rc, out.getvalue(), err.getvalue())


@pytest.mark.integration  # renders PNGs: keeps the unit tier under 3 minutes
def test_report_writes_three_pngs_with_content(tmp_path):
    import matplotlib.image

    r = _cli(str(_summary(tmp_path)))
    assert r.returncode == 0, r.stderr
    paths = r.stdout.split()
    assert [p.rsplit("/", 1)[-1] for p in paths] == ["summary.loss.png", "summary.utilisation.png", "summary.bytes.png"]
    for p in paths:
        img = matplotlib.image.imread(p)
        assert img.shape[0] > 300 and img.shape[1] > 600, (p, img.shape)
        # not blank: a good share of the pixels are neither white nor one colour
        ink = (img[..., :3] < 0.9).any(axis=-1).mean()
        colours = np.unique((img[..., :3] * 255).astype(np.int64) @ np.array([65536, 256, 1])).size
        assert 0.02 < ink < 0.5 and colours > 50, (p, ink, colours)


@pytest.mark.integration  # renders PNGs
def test_report_plots_one_peers_summary(tmp_path):
    """One peer's summary (main.py --rendezvous ... --summary-json): its ``peer_result``."""
    d = json.loads(_summary(tmp_path).read_text())
    one = tmp_path / "peer.json"
    one.write_text(json.dumps({"mode": "peer", "peer_result": d["peers"][0]}))
    r = _cli(str(one))
    assert r.returncode == 0 and len(r.stdout.split()) == 3, r.stderr


def test_report_out_dir_and_bad_summaries(tmp_path):
    src = _summary(tmp_path)
    r = _cli(str(src), "--out-dir", str(tmp_path / "plots"))
    assert r.returncode == 0 and sorted(p.name for p in (tmp_path / "plots").iterdir()) == [
        "summary.bytes.png",
        "summary.loss.png",
        "summary.utilisation.png",
    ], r.stderr
    for bad, why in [
        (tmp_path / "missing.json", "No such file"),
        (tmp_path / "garbage.json", "not JSON"),
        (tmp_path / "launcher.json", "no per-round logs"),
    ]:
        if bad.name == "garbage.json":
            bad.write_text("{not json")
        if bad.name == "launcher.json":
            bad.write_text(json.dumps({"peers": [{"peer": "a", "summary": {}}]}))
        r = _cli(str(bad))
        assert r.returncode == 2 and why in r.stderr and r.stderr.count("\n") == 1, (bad, r.stderr)


def _stage_summary(tmp_path):
    """A ``main.py --local-peers 4 --stages 2`` summary as examples/char_lm writes it: each peer a
    stage of a cluster, its round log ``RoundMetrics`` as dicts with the last stage's train loss
    (examples/char_lm/pipe_peer.py: round_log), its stage's bytes instead of ``params``."""
    peers = []
    for i in range(4):
        cluster, stage = divmod(i, 2)
        log = []
        for r in range(3):
            m = round_metrics(
                r, 0, 4 * (r + 1), 4 * (r + 1) + 1, 0.6, 0.1 * stage, 0.95 - 0.1 * r,
                record=_Record(r, 11_554 + 2000 * stage), payload_bytes=11_474, float_bytes=83_328, state_digest=f"s{r}",
            )  # fmt: skip
            log.append({**dataclasses.asdict(m), "train_loss": 5.0 - 0.4 * r - 0.1 * cluster if stage == 1 else None})
        peers.append(
            {
                "peer": f"peer{i}", "run_id": "char-lm-x", "pipeline": True, "role": "active", "cluster": cluster,
                "stage": stage, "stage_param_bytes": 83_328 + 1000 * stage, "end_step": 12, "steps": 12,
                "eval_loss_start": 6.14 if stage == 1 else None, "eval_loss_end": 3.84 if stage == 1 else None,
                "utilisation": 0.6 + 0.1 * stage, "bubble_fraction": 0.4 - 0.1 * stage,
                "activation_bytes_sent": 108_672, "outer_rounds": 3, "round_log": log,
            }
        )  # fmt: skip
    path = tmp_path / "stages.json"
    path.write_text(json.dumps({"mode": "local_swarm", "pipeline": True, "peers": peers, "stages": []}))
    return path


@pytest.mark.integration  # renders PNGs
def test_report_plots_a_stages_summary_per_stage_group(tmp_path):
    import matplotlib.image

    r = _cli(str(_stage_summary(tmp_path)))
    assert r.returncode == 0, r.stderr
    paths = r.stdout.split()
    assert [p.rsplit("/", 1)[-1] for p in paths] == ["stages.loss.png", "stages.utilisation.png", "stages.bytes.png"]
    shapes = {p.rsplit(".", 2)[-2]: matplotlib.image.imread(p).shape for p in paths}
    # a column per stage group: wider than the one-group plots (880 px)
    assert shapes["utilisation"][1] > 1000 and shapes["bytes"][1] > 1000, shapes
    assert shapes["loss"][1] > 600, shapes
