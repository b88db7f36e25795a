#!/usr/bin/env bash
# DeepSpeed's own launcher, for those who run it: with HOSTFILE (lines "host slots=8") it starts NPROC
# processes on every host over ssh/pdsh; without, NPROC processes here.
#   HOSTFILE=hostfile launch/deepspeed.sh configs/tiny.yaml parallel.backend=deepspeed parallel.zero_stage=2
#   NPROC=2 launch/deepspeed.sh configs/tiny.yaml parallel.deepspeed_config=ds_config.json ...
# --num_gpus is always passed: on a CPU machine DeepSpeed's accelerator reports one device and would start
# one process. --no_local_rank: dist_llm reads LOCAL_RANK from the environment, not from --local_rank.
set -euo pipefail
config=${1:?usage: $0 CONFIG [section.key=value ...]}
shift
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
hosts=()
[ -n "${HOSTFILE:-}" ] && hosts=(--hostfile "$HOSTFILE")
exec "${DEEPSPEED:-deepspeed}" "${hosts[@]}" --num_gpus "$NPROC" --master_port "${MASTER_PORT:-29500}" \
  --no_local_rank --module dist_llm.train --config "$config" "$@"
