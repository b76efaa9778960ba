"""rj.Codec: every codec setting of a run as one value, checked when made, given once to
rj.Swarm (rj.OuterSync reads it there) and to rj.compress.simulated."""

from __future__ import annotations

import pytest

import ravnest_jax as rj
from ravnest_jax.compress import Codec


@pytest.mark.parametrize(
    "fields, match",
    [
        ({"name": "int3"}, "unknown codec 'int3'"),
        ({"name": "fp16"}, "unknown codec 'fp16'; available: fp32, bf16, int8, int4, fp4, int2, sign, topk$"),
        ({"name": "int8", "fraction": 0.1}, "'fraction' does not apply to codec 'int8'"),
        ({"name": "bf16", "block_size": 64}, "'block_size' does not apply to codec 'bf16'"),
        ({"name": "sign", "block_size": 48}, "power of two"),
        ({"name": "topk", "fraction": 1.5}, "'fraction' must be a number in"),
        ({"name": "int8", "mean": "topk"}, "block codecs"),
        ({"name": "fp32", "mean": "int2"}, "block codecs"),
        ({"name": "int8", "mean": "int2", "block_size": 6}, "block_size"),
        ({"name": "int8", "mean_ef": 1}, "Codec.mean_ef must be True or False"),
        ({"name": "int8", "error_feedback": "yes"}, "Codec.error_feedback must be True or False"),
        ({"name": "int8", "error_feedback_decay": 1.5}, "error_feedback_decay must be a number in"),
        ({"name": "int8", "error_feedback_decay": True}, "error_feedback_decay must be a number in"),
        ({"name": "int2", "stochastic": True}, "'stochastic' does not apply"),
    ],
)
def test_a_bad_setting_is_one_line_naming_it(fields, match):
    with pytest.raises(ValueError, match=match) as e:
        Codec(**fields)
    assert "\n" not in str(e.value)


def test_fp16_is_refused_by_the_swarm_and_by_ravnest_codec(monkeypatch):
    # fp16 was dropped (bf16 is the half-precision codec): rj.Swarm(codec=) and $RAVNEST_CODEC (what
    # `ravnest-jax local --codec` sets) refuse it in one line naming the valid codecs
    valid = "fp32, bf16, int8, int4, fp4, int2, sign, topk"
    assert ", ".join(rj.compress.CODECS) == valid
    monkeypatch.delenv("RAVNEST_CODEC", raising=False)
    with pytest.raises(ValueError, match=f"unknown codec 'fp16'; available: {valid}$"):
        rj.Swarm("http://127.0.0.1:1", run_id="r", token="t", codec="fp16", listen=None)
    monkeypatch.setenv("RAVNEST_CODEC", "fp16")
    with pytest.raises(ValueError, match=f"RAVNEST_CODEC='fp16': unknown codec; available: {valid}$") as e:
        rj.Swarm("http://127.0.0.1:1", run_id="r", token="t", listen=None)
    assert "\n" not in str(e.value)


def test_equal_settings_are_equal_values():
    assert Codec("sign", mean="sign") == Codec("sign")  # the mean's own codec, spelled out
    assert Codec("int8") != Codec("int8", block_size=128)
    assert hash(Codec("int4", block_size=32)) == hash(Codec("int4", block_size=32))
    assert Codec.of("int8") == Codec("int8") and Codec.of(None) == Codec("fp32")
    c = Codec("sign", block_size=512, mean="int2", mean_ef=True)
    assert Codec.of(c) is c
    with pytest.raises(TypeError, match="rj.Codec or a codec name"):
        Codec.of({"codec": "int8"})
    with pytest.raises(dataclasses_frozen_error()):
        c.name = "int8"  # type: ignore[misc]


def dataclasses_frozen_error() -> type[Exception]:
    import dataclasses

    return dataclasses.FrozenInstanceError


def test_its_manifest_is_what_peers_must_share():
    c = Codec("sign", block_size=512, mean="int2", mean_ef=True, error_feedback_decay=0.9)
    assert c.manifest() == {
        "codec": "sign",
        "codec_options": {"block_size": 512},
        "mean_codec": "int2",
        "mean_error_feedback": True,
    }
    # nothing to carry with fp32; the peer-local error feedback is not a run setting
    assert Codec("fp32", mean_ef=True).manifest()["mean_error_feedback"] is False
    assert Codec("int8", error_feedback=False).manifest() == Codec("int8").manifest()
    assert str(c) == "Codec('sign', block_size=512, mean='int2', mean_ef=True, error_feedback_decay=0.9)"


def test_given_once_to_the_swarm_the_outer_loop_and_the_simulation_take_it_from_there():
    import optax

    c = Codec("topk", fraction=0.05, error_feedback_decay=0.95)
    swarm = rj.Swarm("http://127.0.0.1:1", run_id="r", token="t", codec=c, listen=None)  # not started
    tx = rj.diloco(optax.sgd(0.1), sync_every=4)
    sync = rj.OuterSync(tx, swarm)
    assert swarm.codec is c and sync.codec is c
    assert (sync._fns.codec, sync._fns.codec_options, sync._fns.error_feedback_decay) == (
        "topk",
        {"fraction": 0.05},
        0.95,
    )
    assert rj.OuterSync(tx, swarm, codec=Codec("topk", fraction=0.05, error_feedback_decay=0.95)).codec == c
    with pytest.raises(ValueError, match="is not the swarm's"):
        rj.OuterSync(tx, swarm, codec=Codec("topk", fraction=0.05))  # another decay
    sim = rj.compress.simulated(c)
    assert (sim.cfg.codec, sim.cfg.fraction, sim.decay, sim.error_feedback) == ("topk", 0.05, 0.95, True)
    # a name stands for Codec(name), everywhere
    assert rj.Swarm("http://127.0.0.1:1", run_id="r", token="t", codec="int8", listen=None).codec == Codec("int8")
