#!/usr/bin/env bash
# Single-node LoopQ calibration under DeepSpeed ZeRO: torchrun starts one process per GPU (the `deepspeed`
# launcher is not needed) with LoopQDeepSpeedStrategy and per-loop activation checkpointing.
#
#   launch/deepspeed.sh CONFIG [NPROC] [CLI overrides...]
#   launch/deepspeed.sh configs/ouro2.6b.yaml 4
#   ZERO_STAGE=3 launch/deepspeed.sh configs/ouro2.6b.yaml 8 --ckpt_path last
#   DS_CONFIG=my_zero.json launch/deepspeed.sh configs/ouro2.6b.yaml 4      # a full DeepSpeed JSON config
#
# ZERO_STAGE: 2 (default: optimizer state and gradients sharded) or 3 (parameters too, gathered per module).
# SLT promotes progressively, as under DDP (the parameter layout is fixed from the start). Checkpoints are
# directories (<default_root_dir>/checkpoints/last.ckpt/, one shard per rank under ZeRO-3, plus loopq.json);
# --ckpt_path last resumes from them. Rank 0 writes the gathered student at the end. Batch: as torchrun.sh.
# CPU test runs: LOOPQ_DEEPSPEED_SHM=0 skips DeepSpeed's 40-60 s JIT build of its shared-memory CPU op.
set -euo pipefail
cd "$(dirname "$0")/.."
source launch/common.sh

CONFIG=${1:?usage: launch/deepspeed.sh CONFIG [NPROC] [overrides...]}
shift
if [[ $# -gt 0 && $1 =~ ^[0-9]+$ ]]; then NPROC=$1; shift; else NPROC=$(visible_gpus); fi
PER_PROCESS=$(per_process_batch "$CONFIG" "$NPROC")
if [[ -n ${DS_CONFIG:-} ]]; then INIT="{\"config\": \"$DS_CONFIG\"}"; else INIT="{\"stage\": ${ZERO_STAGE:-2}}"; fi
STRATEGY="{\"class_path\": \"loopq.calib.deepspeed.LoopQDeepSpeedStrategy\", \"init_args\": $INIT}"

exec torchrun --standalone --nproc_per_node="$NPROC" -m loopq.fit --config "$CONFIG" \
    --trainer.strategy "$STRATEGY" --model.checkpoint_loops true \
    --trainer.devices "$NPROC" --trainer.num_nodes 1 --data.batch_size "$PER_PROCESS" "$@"
