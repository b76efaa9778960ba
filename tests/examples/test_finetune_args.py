"""examples/finetune/train.py's arguments: ``--devices`` is checked before anything starts."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
from finetune.train import parse_args  # noqa: E402

CKPT = ["--checkpoint", "ckpt"]


def test_devices_must_divide_the_batch_and_be_positive(capsys):
    assert parse_args([*CKPT, "--devices", "2", "--batch-size", "4"]).devices == 2
    assert parse_args(CKPT).devices == 1
    for bad in (["--devices", "3", "--batch-size", "4"], ["--devices", "0"]):
        with pytest.raises(SystemExit):
            parse_args([*CKPT, *bad])
        assert "--devices" in capsys.readouterr().err
