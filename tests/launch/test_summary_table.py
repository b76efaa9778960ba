"""``ravnest-jax local``'s closing table: the peers' summaries, with the eval loss columns when
the peers report them (the fine-tuning example does), without them otherwise."""

from __future__ import annotations

from ravnest_jax.launch import print_summaries


def test_the_table_shows_the_eval_loss_when_a_peer_reports_it():
    lines: list[str] = []
    common = {"rounds": 3, "failed_rounds": 0, "resyncs": 0, "bytes_sent": 12345, "last_state_digest": "ab" * 8}
    summaries = {
        "peer0": {**common, "eval_loss_start": 4.93, "eval_loss_end": 3.737},
        "peer1": {**common, "eval_loss_end": None},
    }
    assert print_summaries(summaries, {"peer0": 0, "peer1": 0}, lines.append)
    assert lines[0].split()[2:4] == ["eval", "start"] and "eval end" in lines[0], lines
    assert lines[1].split()[2:4] == ["4.9300", "3.7370"] and lines[2].split()[2:4] == ["-", "-"], lines
    assert lines[-1] == "global state: identical on every peer", lines
    plain: list[str] = []
    print_summaries({"peer0": common}, {"peer0": 0}, plain.append)
    assert "eval" not in plain[0] and plain[1].split()[:3] == ["peer0", "0", "3"], plain
