#!/usr/bin/env bash
# Train on all local GPUs (or NPROC CPU processes) of this machine with torchrun's standalone rendezvous.
#   launch/torchrun_single_node.sh configs/tiny.yaml train.max_steps=100
#   NPROC=2 launch/torchrun_single_node.sh configs/tiny.yaml
set -euo pipefail
config=${1:?usage: $0 CONFIG [section.key=value ...]}
shift
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
exec "${PYTHON:-python}" -m torch.distributed.run --standalone --nproc-per-node "$NPROC" \
  -m dist_llm.train --config "$config" "$@"
