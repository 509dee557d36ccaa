#!/usr/bin/env bash
# Single-node, multi-GPU LoopQ calibration: one process per GPU under torchrun.
#
#   launch/torchrun.sh CONFIG [NPROC] [CLI overrides...]
#   launch/torchrun.sh configs/ouro1.4b.yaml 4
#   launch/torchrun.sh configs/ouro1.4b.yaml 4 --model.quant.a_bits 8 --ckpt_path last
#
# NPROC defaults to the number of visible GPUs. The config's strategy is kept (Ouro 1.4B / LoopFormer / Parcae:
# DDP with find_unused_parameters; configs/ouro2.6b.yaml: DeepSpeed ZeRO-2); a config without one gets
# ddp_find_unused_parameters_true. The config's data.batch_size is the global batch and is split across the
# processes (loopq.fit's data.batch_size is per process), so N GPUs compute the same global batches as one GPU;
# GLOBAL_BATCH=8 overrides it (must be divisible by NPROC). Overrides come last and win.
set -euo pipefail
cd "$(dirname "$0")/.."
source launch/common.sh

CONFIG=${1:?usage: launch/torchrun.sh CONFIG [NPROC] [overrides...]}
shift
if [[ $# -gt 0 && $1 =~ ^[0-9]+$ ]]; then NPROC=$1; shift; else NPROC=$(visible_gpus); fi
PER_PROCESS=$(per_process_batch "$CONFIG" "$NPROC")
# shellcheck disable=SC2046
exec torchrun --standalone --nproc_per_node="$NPROC" -m loopq.fit --config "$CONFIG" $(ddp_default "$CONFIG") \
    --trainer.devices "$NPROC" --trainer.num_nodes 1 --data.batch_size "$PER_PROCESS" "$@"
