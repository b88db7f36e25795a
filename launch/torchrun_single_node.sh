#!/usr/bin/env bash
# Train on all local GPUs (or NPROC CPU processes) of this machine with torchrun's standalone rendezvous
# (dist_llm.torchrun: torchrun itself, its failure report cut to the line the workers did not already say).
#   launch/torchrun_single_node.sh configs/tiny.yaml train.max_steps=100
#   NPROC=2 launch/torchrun_single_node.sh configs/tiny.yaml
set -euo pipefail
config=${1:?usage: $0 CONFIG [section.key=value ...]}
shift
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
exec "${PYTHON:-python}" -m dist_llm.torchrun --standalone --nproc-per-node "$NPROC" \
  -m dist_llm.train --config "$config" "$@"
