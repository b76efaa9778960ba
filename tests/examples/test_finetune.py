"""LoRA fine-tuning across real peer processes (examples/finetune): 4 peers on a tiny pretrained
Llama-style checkpoint agree on every round, send the adapters' encoded size per round and
nothing else, and land within 2% of one process training the same adapters on the same tokens;
a LoRA peer stopped at 20 steps and resumed equals 40 uninterrupted steps, on one device and
on two (``--devices 2``); an int4 base trains like the bf16 one; bad input is one line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("qwix")
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
sys.path.insert(0, str(EXAMPLES))
TRAIN = EXAMPLES / "finetune" / "train.py"

pytestmark = [pytest.mark.integration, pytest.mark.slow]

# small enough for 2 CPU cores, large enough that the adapters learn (eval loss falls > 5%)
COMMON = ["--batch-size", "4", "--seq-len", "32", "--eval-batches", "2", "--lr", "3e-3", "--lora-rank", "8"]


@pytest.fixture(scope="module")
def tiny() -> Path:
    """The example's tiny checkpoint, committed (``python examples/finetune/tiny.py
    tests/fixtures/llm/finetune --vocab-size 384``; 300 pretraining steps take a minute here)."""
    return Path(__file__).resolve().parents[1] / "fixtures" / "llm" / "finetune"


def test_make_tiny_checkpoint_writes_a_loadable_hugging_face_checkpoint(tmp_path):
    from finetune.tiny import make_tiny_checkpoint, stdlib_docs
    from ravnest_jax.data import eos_token_id, load_tokenizer, tokenize
    from ravnest_jax.models import load_pretrained

    root = make_tiny_checkpoint(tmp_path / "t", vocab_size=300, pretrain_steps=2)
    tok = load_tokenizer(root)
    ids = tokenize(stdlib_docs(8192), tok, eos_id=eos_token_id(root))
    assert tok.get_vocab_size() == 300 and eos_token_id(root) == tok.token_to_id("<|endoftext|>")
    model = load_pretrained(root)
    assert model.config.vocab_size == 300 and model(ids[None, :16]).shape == (1, 16, 300)


def _swarm(tmp: Path, peers: int, args: list[str], name: str) -> dict:
    summary = tmp / f"{name}.json"
    cmd = [
        sys.executable,
        "-m",
        "ravnest_jax.cli",
        "local",
        "--peers",
        str(peers),
        "--codec",
        "int4",
        "--no-progress",
        "--summary-json",
        str(summary),
        "--",
        sys.executable,
        str(TRAIN),
        *args,
    ]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, f"{name}: exit {p.returncode}\n{p.stderr[-3000:]}"
    out = json.loads(summary.read_text())["peers"]
    assert len(out) == peers and all(v["exit"] == 0 for v in out.values()), out
    # each peer's own last line (train.py's JSON summary), as the launcher prefixes it
    lines = {}
    for line in p.stdout.splitlines():
        if line.startswith("[peer") and "] {" in line:
            name, _, rest = line[1:].partition("] ")
            lines[name] = json.loads(rest)
    assert sorted(lines) == sorted(out), (sorted(lines), p.stdout[-2000:])
    return lines


def test_four_peers_agree_send_adapters_only_and_match_one_process(tiny, tmp_path):
    import ravnest_jax as rj
    from finetune.reference import Setup, train_data_parallel
    from ravnest_jax.models import LoraConfig, load_pretrained, split_lora

    steps, h = 40, 10
    args = [
        "--checkpoint",
        str(tiny),
        "--max-steps",
        str(steps),
        "--sync-every",
        str(h),
        "--overlap-steps",
        "0",
        *COMMON,
    ]
    peers = _swarm(tmp_path, 4, args, "four")
    digests = {s["last_state_digest"] for s in peers.values()}
    assert len(digests) == 1 and all(s["rounds"] == steps // h and s["failed_rounds"] == 0 for s in peers.values()), (
        peers
    )

    # a round carries the adapters, encoded: exactly their int4 message; on this 64-wide model
    # rank-8 A and B on every projection are 14% of the parameters (Llama 3.1 8B, rank 16: 0.5%)
    lm = split_lora(load_pretrained(tiny, lora=LoraConfig(rank=8, alpha=16.0)))
    adapters = [np.asarray(x) for x in __import__("jax").tree.leaves(lm.adapters)]
    full = [
        np.asarray(x, np.float32)
        for x in __import__("jax").tree.leaves(lm.frozen)
        if np.issubdtype(x.dtype, np.floating)
    ]
    want = len(rj.compress.encode(adapters, "int4"))
    for s in peers.values():
        assert s["round_payload_bytes"] == [want], (s["round_payload_bytes"], want)
    assert want < 0.2 * len(rj.compress.encode(full, "int4")), (want, len(rj.compress.encode(full, "int4")))

    # one process, the same adapters, the same tokens (all four shards' batches each step)
    ref = train_data_parallel(
        Setup(
            checkpoint=str(tiny),
            peers=4,
            max_steps=steps,
            batch_size=4,
            seq_len=32,
            eval_batches=2,
            lr=3e-3,
            lora_rank=8,
        )
    )
    swarm = peers["peer0"]["eval_loss_end"]
    start = peers["peer0"]["eval_loss_start"]
    assert start == pytest.approx(ref["eval_loss_start"], rel=1e-6), (start, ref)
    assert ref["eval_loss_end"] < 0.95 * start and swarm < 0.95 * start, (start, swarm, ref)
    gap = abs(swarm - ref["eval_loss_end"]) / ref["eval_loss_end"]
    assert gap < 0.02, f"swarm eval {swarm:.4f} vs one process {ref['eval_loss_end']:.4f}: {100 * gap:.2f}% apart"


def test_lora_peer_resumes_exactly(tiny, tmp_path):
    base = ["--checkpoint", str(tiny), "--sync-every", "10", "--overlap-steps", "0", *COMMON]
    straight = _swarm(tmp_path, 1, [*base, "--max-steps", "40", "--checkpoint-dir", str(tmp_path / "a")], "straight")
    first = _swarm(tmp_path, 1, [*base, "--max-steps", "20", "--checkpoint-dir", str(tmp_path / "b")], "first")
    second = _swarm(tmp_path, 1, [*base, "--max-steps", "40", "--checkpoint-dir", str(tmp_path / "b")], "second")
    s, f, r = straight["peer0"], first["peer0"], second["peer0"]
    assert f["steps"] == 20 and r["how"] == "resumed" and r["steps"] == 40, (f, r)
    assert r["data_position"] == s["data_position"] == 40
    assert r["last_state_digest"] == s["last_state_digest"], (r, s)
    assert r["eval_loss_end"] == s["eval_loss_end"], (r["eval_loss_end"], s["eval_loss_end"])


def test_int4_base_trains_like_the_bf16_base(tiny):
    from finetune.reference import Setup, train_data_parallel

    common = dict(
        checkpoint=str(tiny), peers=2, max_steps=40, batch_size=4, seq_len=32, eval_batches=2, lr=3e-3, dtype="bfloat16"
    )
    bf16 = train_data_parallel(Setup(**common))
    int4 = train_data_parallel(Setup(**common, quantize="int4"))
    assert bf16["eval_loss_end"] < 0.95 * bf16["eval_loss_start"], bf16
    gap = abs(int4["eval_loss_end"] - bf16["eval_loss_end"]) / bf16["eval_loss_end"]
    assert gap < 0.02, f"int4 base {int4} vs bf16 base {bf16}: {100 * gap:.2f}% apart"


@pytest.mark.parametrize(
    "args, msg",
    [
        (["--checkpoint", "/nonexistent/ckpt"], "no config.json at /nonexistent/ckpt"),
        (["--text", "/nonexistent.txt"], "--text: no such file"),
        (["--lora-targets", "q", "attn"], "unknown LoRA target 'attn'"),
    ],
)
def test_bad_input_is_one_line_before_anything_compiles(tiny, args, msg):
    full = ["--checkpoint", str(tiny), *args] if args[0] != "--checkpoint" else args
    p = subprocess.run([sys.executable, str(TRAIN), *full], capture_output=True, text=True, timeout=120)
    assert p.returncode != 0 and msg in p.stderr, p.stderr
    assert "Traceback" not in p.stderr and len(p.stderr.strip().splitlines()) == 1, p.stderr


def test_lora_fine_tuning_split_into_two_stages_and_two_clusters(tiny, tmp_path):
    """``train.py --stages 2`` under the launcher with 4 peers: 2 clusters x 2 stages of the LoRA
    model; each stage's adapters average with DiLoCo inside its group (equal digests per round),
    and int8 activations cross between the stages; the eval loss through the pipeline is finite.
    ``--export-adapters``: the first cluster's peer of each stage writes its part, and the parts
    become one PEFT directory covering every layer, the trained adapters in it."""
    from ravnest_jax.models import load_pretrained, merge_peft_adapters, read_peft_adapters

    out = tmp_path / "adapters"
    args = ["--checkpoint", str(tiny), *COMMON, "--max-steps", "20", "--sync-every", "5", "--stages", "2"]
    lines = _swarm(tmp_path, 4, [*args, "--export-adapters", str(out)], "stages")
    by = {(v["cluster"], v["stage"]): v for v in lines.values()}
    assert sorted(by) == [(0, 0), (0, 1), (1, 0), (1, 1)], sorted(by)
    for s in (0, 1):
        a, b = by[(0, s)]["round_digests"], by[(1, s)]["round_digests"]
        assert len(a) == 4 and a == b, (s, a, b)
        assert by[(0, s)]["activation_bytes_sent"] > 0 and 0 < by[(0, s)]["utilisation"] <= 1
    assert by[(0, 0)]["round_digests"] != by[(0, 1)]["round_digests"]
    evals = [by[(c, 1)]["eval_loss_end"] for c in (0, 1)]
    assert all(e is not None and e < 6.0 for e in evals), evals
    parts = {s: by[(0, s)].get("exported_adapter_part") for s in (0, 1)}
    assert all(parts.values()) and not any(by[(1, s)].get("exported_adapter_part") for s in (0, 1)), parts
    assert [by[(0, s)].get("exported_adapters") for s in (0, 1)].count(str(out)) == 1, by
    assert sorted(p.name for p in out.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    config, tensors = read_peft_adapters(out)
    model = load_pretrained(tiny, scan_layers=False)
    layers = model.config.num_hidden_layers
    assert config["r"] == 8 and len(tensors) == layers * 7 * 2, (config["r"], len(tensors), layers)
    assert {int(n.split(".layers.")[1].split(".")[0]) for n in tensors} == set(range(layers))
    trained_b = [float(np.abs(v).max()) for n, v in tensors.items() if "lora_B" in n]
    assert min(trained_b) > 0, "every B trained away from its zero initialisation"
    merge_peft_adapters(model, out)  # loads onto the base: every name and shape fits


def test_a_peer_on_two_devices_resumes_exactly(tiny, tmp_path):
    """``--devices 2``: the peer's int4 base and adapters FSDP-style over 2 (CPU) devices, the
    batch split; stopped at 20 steps and resumed from its checkpoint (restored in the
    adapters' layout), it equals 30 uninterrupted steps on 2 devices, bit for bit."""
    base = ["--checkpoint", str(tiny), "--sync-every", "10", "--overlap-steps", "0", *COMMON]
    base += ["--quantize", "int4", "--devices", "2"]
    straight = _swarm(tmp_path, 1, [*base, "--max-steps", "30", "--checkpoint-dir", str(tmp_path / "a")], "straight")
    first = _swarm(tmp_path, 1, [*base, "--max-steps", "20", "--checkpoint-dir", str(tmp_path / "b")], "first")
    second = _swarm(tmp_path, 1, [*base, "--max-steps", "30", "--checkpoint-dir", str(tmp_path / "b")], "second")
    s, f, r = straight["peer0"], first["peer0"], second["peer0"]
    assert s["devices"] == f["devices"] == r["devices"] == 2, (s, f, r)
    assert f["steps"] == 20 and r["how"] == "resumed" and r["steps"] == 30 and r["data_position"] == 30, (f, r)
    assert r["last_state_digest"] == s["last_state_digest"], (r, s)
    assert r["eval_loss_end"] == s["eval_loss_end"], (r["eval_loss_end"], s["eval_loss_end"])


def test_stage_peers_stopped_and_started_again_resume_exactly(tiny, tmp_path):
    """``--stages 2 --checkpoint-dir``, 2 clusters x 2 stages: 10 steps, then the whole run
    started again to 20 on the same directory: every stage peer resumes at step 10 (its stage
    group's common checkpoint), and the last round's digest of each stage group and each
    cluster's eval loss equal those of 20 uninterrupted steps, bit for bit."""
    base = ["--checkpoint", str(tiny), *COMMON, "--sync-every", "5", "--overlap-steps", "0", "--stages", "2"]
    ck = ["--checkpoint-dir", str(tmp_path / "ck")]
    _swarm(tmp_path, 4, [*base, "--max-steps", "10", *ck], "first")
    resumed = _swarm(tmp_path, 4, [*base, "--max-steps", "20", *ck], "again")
    whole = _swarm(tmp_path, 4, [*base, "--max-steps", "20"], "whole")

    def by_slot(lines: dict) -> dict:
        return {(v["cluster"], v["stage"]): v for v in lines.values()}

    got, want = by_slot(resumed), by_slot(whole)
    assert sorted(got) == sorted(want) == [(0, 0), (0, 1), (1, 0), (1, 1)], (sorted(got), sorted(want))
    for slot, v in got.items():
        assert v["resumed_from"] == 10 and v["steps"] == 10, (slot, v["resumed_from"], v["steps"])
        assert want[slot]["resumed_from"] is None, want[slot]
        last = lambda d: d["round_digests"][max(d["round_digests"], key=int)]  # noqa: E731
        assert last(v) == last(want[slot]), (slot, v["round_digests"], want[slot]["round_digests"])
        assert v["eval_loss_end"] == want[slot]["eval_loss_end"], (
            slot,
            v["eval_loss_end"],
            want[slot]["eval_loss_end"],
        )
