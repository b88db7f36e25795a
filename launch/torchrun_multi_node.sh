#!/usr/bin/env bash
# Train on NNODES machines: run this same command on every node (or let launch/slurm.sbatch do it).
#   NNODES=4 NODE_RANK=0 MASTER_ADDR=node0 MASTER_PORT=29500 launch/torchrun_multi_node.sh configs/3d.yaml
#   NNODES=4 RDZV_ENDPOINT=node0:29500 launch/torchrun_multi_node.sh configs/3d.yaml train.max_steps=100
# NPROC: processes per node (default: its GPUs, else 1). c10d rendezvous under RDZV_ID (default: the SLURM job
# id, else one named after the rendezvous endpoint, the same on every node and kept across restarts),
# so the job re-forms after a failure, up to MAX_RESTARTS (default 3) times, and resumes from its newest
# checkpoint (train.resume=auto). Ranks are numbered node by node: a node's processes get consecutive ranks,
# which the mesh ("pp", "dp", "tp") puts in one tensor-parallel group.
set -euo pipefail
config=${1:?usage: $0 CONFIG [section.key=value ...]}
shift
: "${NNODES:?set NNODES (the number of nodes)}"
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
endpoint=${RDZV_ENDPOINT:-${MASTER_ADDR:?set MASTER_ADDR (or RDZV_ENDPOINT)}:${MASTER_PORT:-29500}}
node_rank=()
[ -n "${NODE_RANK:-}" ] && node_rank=(--node-rank "$NODE_RANK")
exec "${PYTHON:-python}" -m dist_llm.torchrun --nnodes "$NNODES" --nproc-per-node "$NPROC" "${node_rank[@]}" \
  --rdzv-backend c10d --rdzv-endpoint "$endpoint" --rdzv-id "${RDZV_ID:-${SLURM_JOB_ID:-dist_llm-${endpoint}}}" \
  --max-restarts "${MAX_RESTARTS:-3}" -m dist_llm.train --config "$config" "$@"
