#!/usr/bin/env bash
# The GPU checks, as prepared runs on a machine with a GPU (a lent one: its python3 has JAX with
# CUDA, torch, transformers, peft and safetensors, and no network: packages it lacks - qwix,
# blake3, isal - come as wheels built for its Python 3.12 in .whl/, see docs/benchmarks-lora-gpu.md
# for the pip download command). Results go to $OUT (default benchmarks/results). Stages, named as
# arguments (default: overhead convergence, about 8 minutes together):
#   overhead (<= 2.5 min): step_overhead_gpu.json: the char-LM at width 1024 (8 layers, ~100M
#      params) on the GPU: the rj.diloco wrapper's step overhead against plain AdamW, and the
#      device memory of a round (fp32 and int4) - bench_step_overhead.py
#   convergence (<= 5.5 min): convergence_gpu.json/.png: convergence sweep cells
#      (bench_convergence.py --sweep), many at a time on the one GPU, 3 seeds each; the text is the
#      standard library of the Python in .corpus/stdlib311.tar.xz when that is there (the same
#      bytes as on the CPU machines) (CHAR_LM_STDLIB), else the GPU machine's own.
#   lora (<= 8 min, one call of its own): lora_gpu.json/.png/.md: LoRA / QLoRA fine-tuning of
#      random-init Llama-3.2-1B and Llama-3.1-8B shapes, ours (bf16, int4, nf4, 8B in a 22 GiB
#      pool) against transformers + peft - bench_lora_gpu.py (each case in its own process under
#      a 450 s deadline; writes the random checkpoints to /tmp first, ~1.5 min of it)
#   overlap (<= 5 min, the rerun slot): lora_overlap.json: two peers of the 1B LoRA fine-tune on
#      the one GPU, rounds through the throttling proxy at 100 Mbit/s and 50 ms RTT, blocking
#      against overlap_steps="auto" - bench_lora_gpu.py --overlap (~2.5 min expected)
#
#   bash benchmarks/device_check.sh                 # overhead + convergence; SWEEP_S=330: the sweep's limit (s)
#   bash benchmarks/device_check.sh lora            # then, in a second call:
#   bash benchmarks/device_check.sh overlap
set -u
cd "$(dirname "$0")/.."
OUT=$(realpath -m "${OUT:-benchmarks/results}")
mkdir -p "$OUT"
if ls .whl/*.whl >/dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site || exit 1
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
if [ -f .corpus/stdlib311.tar.xz ]; then
    mkdir -p /tmp/stdlib && tar -C /tmp/stdlib -xJf .corpus/stdlib311.tar.xz && export CHAR_LM_STDLIB=/tmp/stdlib
fi
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
nvidia-smi -L 2>/dev/null
python3 -c "import jax, flax, optax; print('jax', jax.__version__, jax.devices(), 'flax', flax.__version__, 'optax', optax.__version__)"
STAGES=" ${*:-overhead convergence} "
want() { [[ "$STAGES" == *" $1 "* ]]; }

if want lora; then
    timeout 480 python3 benchmarks/bench_lora_gpu.py --out "$OUT" 2>&1 | grep -v "^WARNING" | tail -30
fi
if want overlap; then
    timeout 330 python3 benchmarks/bench_lora_gpu.py --overlap --out "$OUT" 2>&1 | grep -v "^WARNING" | tail -20
fi
want overhead || want convergence || exit 0

want overhead && timeout "${STEP_S:-150}" python3 benchmarks/bench_step_overhead.py --d-model 1024 --layers 8 --heads 16 --seq-len 256 \
    --batch-size 16 --reps 21 --out "$OUT/step_overhead_gpu.json" 2>&1 | tail -8

want convergence || exit 0
B=outer_lr=1.0,outer_momentum=0.0,nesterov=False,inner=muon,inner_lr=0.02
cd benchmarks
timeout "${SWEEP_S:-330}" python3 bench_convergence.py --sweep --seeds 0 1 2 --steps 2000 --jobs "${JOBS:-10}" \
    --sweep-cell codec=fp32,$B \
    --sweep-cell codec=sign:mef,$B \
    --sweep-cell codec=int2:256/sign:256:mef,$B \
    --sweep-cell codec=fp32,$B,steps=4000 \
    --sweep-cell codec=sign:mef,$B,steps=4000 \
    --sweep-cell codec=int2:256/sign:256:mef,$B,steps=4000 \
    --sweep-cell codec=sign:mef,$B,ef_decay=0.8 \
    --sweep-cell codec=int2:256/sign:256:mef,$B,ef_decay=0.8 \
    --sweep-cell codec=int2:256:mef,$B \
    --sweep-cell codec=int2:256:mef,$B,sync_every=80 \
    --sweep-cell codec=fp32,$B,sync_every=80 \
    --sweep-cell codec=int2:256:mef,$B,sync_every=100 \
    --sweep-cell codec=sign:256/int2:256:mef,$B \
    --sweep-cell codec=sign:mef,${B/outer_lr=1.0/outer_lr=1.3} \
    --sweep-cell codec=int2:256/sign:256:mef,${B/outer_lr=1.0/outer_lr=1.3} \
    --sweep-cell codec=fp32,${B/outer_lr=1.0/outer_lr=1.3} \
    --sweep-cell codec=int2:256:mef,$B,sync_every=80,steps=4000 \
    --sweep-cell algo=dp,inner=muon,inner_lr=0.02 \
    --sweep-cell algo=dp,inner=muon,inner_lr=0.02,steps=4000 \
    --out "$OUT/convergence_gpu.json" 2>&1 | grep -v "^WARNING" | tail -40
