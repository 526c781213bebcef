#!/usr/bin/env bash
# Launch Megatron-LM's pretrain_gpt.py with torchrun on this node (one call per node).
#
#   MEGATRON_DIR=/path/to/Megatron-LM scripts/launch_torchrun.sh [pretrain_gpt.py arguments...]
#
# Environment (defaults for a single node): NNODES=1 NODE_RANK=0 GPUS_PER_NODE=8
# MASTER_ADDR=127.0.0.1 MASTER_PORT=29500. With --slimpack among the arguments the checkout must
# carry the SlimPack patch (scripts/apply_patches.sh MEGATRON_DIR); this is checked first.
# Python: PYTHON if set (reproduce_paper.sh sets it to its own), otherwise the project's .venv; never
# the system python (scripts/python.sh).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
project="$(cd "$here/.." && pwd)"
source "$here/python.sh"
: "${MEGATRON_DIR:?set MEGATRON_DIR to a Megatron-LM checkout}"
NNODES="${NNODES:-1}"
NODE_RANK="${NODE_RANK:-0}"
GPUS_PER_NODE="${GPUS_PER_NODE:-8}"
MASTER_ADDR="${MASTER_ADDR:-127.0.0.1}"
MASTER_PORT="${MASTER_PORT:-29500}"

for arg in "$@"; do
  if [[ "$arg" == "--slimpack" ]]; then
    status="$("$here/apply_patches.sh" --check "$MEGATRON_DIR" 2>&1)" || true
    if [[ "$status" != *"already applied"* ]]; then
      echo "error: --slimpack needs the SlimPack patch in $MEGATRON_DIR/pretrain_gpt.py: run scripts/apply_patches.sh $MEGATRON_DIR" >&2
      echo "$status" | sed 's/^/       /' >&2
      exit 1
    fi
    break
  fi
done

export PYTHONPATH="$MEGATRON_DIR:$project${PYTHONPATH:+:$PYTHONPATH}"
export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-1}"
cd "$MEGATRON_DIR"
exec "$PYTHON" -m torch.distributed.run \
  --nnodes "$NNODES" --node-rank "$NODE_RANK" --nproc-per-node "$GPUS_PER_NODE" \
  --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT" \
  pretrain_gpt.py "$@"
