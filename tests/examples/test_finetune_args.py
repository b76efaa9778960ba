"""examples/finetune/train.py's arguments: checked before anything starts; the defaults are a GPU's."""

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


def test_main_checks_train_options_before_making_the_tiny_checkpoint(capsys, monkeypatch):
    """A mistyped train.py option is one usage error of main.py, before the tiny checkpoint is
    made (it was each peer's usage dump, after the ~20 s pretraining); --stages is checked
    against --local-peers."""
    import subprocess

    from finetune import main as ft_main

    def no_child(*a, **k):
        raise AssertionError(f"started {a}")

    monkeypatch.setattr(subprocess, "run", no_child)
    monkeypatch.delenv("RAVNEST_WORLD_SIZE", raising=False)
    for bad, needle in [
        (["--local-peers", "2", "--lora-rnak", "8"], "unrecognized arguments: --lora-rnak 8"),
        (["--local-peers", "3", "--stages", "2"], "launcher's peers (3) must be a multiple"),
    ]:
        with pytest.raises(SystemExit) as e:
            ft_main.main(bad)
        assert e.value.code == 2
        assert needle in capsys.readouterr().err
    import os

    assert "RAVNEST_WORLD_SIZE" not in os.environ


def test_gpu_defaults_and_their_checks(capsys):
    a = parse_args(CKPT)
    assert (a.dtype, a.remat, a.attention, a.micro_batches, a.loss_chunk, a.no_donate) == (
        "auto",
        "full",
        "auto",
        1,
        1024,
        False,
    )
    assert parse_args([*CKPT, "--stages", "1"]).micro_batches == 1
    assert parse_args([*CKPT, "--batch-size", "8", "--micro-batches", "4", "--devices", "2"]).micro_batches == 4
    for bad, needle in [
        (["--batch-size", "8", "--micro-batches", "3"], "multiple of --micro-batches x --devices (3 x 1)"),
        (["--remat", "some"], "invalid choice: 'some'"),
        (["--quantize", "int3"], "invalid choice: 'int3'"),
        (["--mem-fraction", "1.5"], "--mem-fraction must be in (0, 1]"),
        (["--loss-chunk", "0"], "--loss-chunk must be >= 1"),
    ]:
        with pytest.raises(SystemExit):
            parse_args([*CKPT, *bad])
        assert needle in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, env, want",
    [([], None, "0.9"), ([], "0.5", "0.5"), (["--mem-fraction", "0.8"], "0.5", "0.8")],
)
def test_memory_fraction_flag_then_environment_then_0_9(monkeypatch, argv, env, want):
    from finetune.train import MEM_FRACTION, set_memory_fraction

    if env is None:
        monkeypatch.delenv(MEM_FRACTION, raising=False)
    else:
        monkeypatch.setenv(MEM_FRACTION, env)
    assert set_memory_fraction([*CKPT, *argv]) == want
    import os

    assert os.environ[MEM_FRACTION] == want


def _main_thread_only():
    import threading

    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signal handlers run in the main thread only")


def test_a_stop_inside_a_step_waits_for_its_end_and_one_between_steps_is_at_once():
    """train.py's StepGuard: Ctrl+C (or SIGTERM) inside a step (its state donated, its batch taken)
    is raised when the step ends, so the checkpoint written at the stop is a whole step with its
    data position (seen before: a crash on donated buffers, and a batch skipped on resume)."""
    import signal

    from finetune.train import StepGuard

    _main_thread_only()
    done = []
    with StepGuard() as guard, pytest.raises(KeyboardInterrupt):
        for i in range(3):
            with guard.step():
                if i == 1:
                    signal.raise_signal(signal.SIGINT)
                done.append(i)  # the rest of the step still runs
    assert done == [0, 1] and not guard.torn, (done, guard.torn)
    with StepGuard() as guard, pytest.raises(KeyboardInterrupt):
        signal.raise_signal(signal.SIGTERM)  # between steps: at once
    assert not guard.torn
    with StepGuard() as guard, pytest.raises(KeyboardInterrupt):
        try:  # a stop while the model loads, swallowed by a callback (XLA's gc callback does)
            signal.raise_signal(signal.SIGINT)
        except KeyboardInterrupt:
            pass
        with guard.step():  # the next step does not start
            done.append("after")
    assert "after" not in done, done
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # handlers restored


def test_a_second_stop_or_a_step_past_the_grace_cuts_the_step():
    import signal
    import threading
    import time

    from finetune.train import StepGuard

    _main_thread_only()
    with StepGuard() as guard, pytest.raises(KeyboardInterrupt), guard.step():
        signal.raise_signal(signal.SIGINT)
        signal.raise_signal(signal.SIGINT)  # the second: at once
        pytest.fail("not reached")
    assert guard.torn
    # a step stuck in a wait (the merge waiting for a round): cut after the grace, woken there
    t0 = time.monotonic()
    with StepGuard(grace=0.3) as guard, pytest.raises(KeyboardInterrupt), guard.step():
        signal.raise_signal(signal.SIGINT)
        threading.Event().wait(30)
    took = time.monotonic() - t0
    assert guard.torn and took < 10, (guard.torn, took)
