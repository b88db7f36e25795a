#!/usr/bin/env bash
# The checks of one lent CUDA GPU, in one command (CI has no GPU; every part here also has a CPU test).
#
#     bash scripts/gpu_check.sh OUTDIR [--no-bench]
#
# 1. the CUDA tests (tests/test_nf4.py's move to the GPU)
# 2. the trainer on the GPU: configs/tiny.yaml fp32 on cuda against the same run on the CPU (losses side by side),
#    bf16 with torch.compile (the SDPA kernel it picked, tokens/s, MFU, peak memory from metrics.jsonl)
# 3. torchrun with one process on the GPU: the NCCL process group (world size 1: one GPU cannot hold two NCCL ranks)
# 4. MoE on the GPU: one layer's grouped path (torch._grouped_mm, bf16) against the naive per-expert loop, and
#    configs/moe.yaml trained in bf16
# 5. `python scripts/bench.py --scenario gpu` (GPT-2 124M and a 1.3B GPT, compiled, bf16, MFU; HF GPT-2 beside)
# Each part prints "== NAME exit CODE in S s" and goes on after a failure; logs and JSON land in OUTDIR.
set -u
out=${1:?usage: bash scripts/gpu_check.sh OUTDIR [--no-bench]}
bench=${2:-}
mkdir -p "$out"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
py=${PYTHON:-python3}

part() {  # part NAME SECONDS COMMAND...: run with a time limit, log to OUTDIR/NAME.log, say how it ended
  local name=$1 limit=$2 start
  shift 2
  start=$(date +%s)
  echo "== $name"
  timeout "$limit" "$@" >"$out/$name.log" 2>&1
  local code=$?
  tail -n 15 "$out/$name.log"
  echo "== $name exit $code in $(($(date +%s) - start)) s"
}

# tiny steps of a config: no eval, no checkpoints, a metrics line each step
train=($py -m dist_llm.cli train train.eval_interval=0 train.ckpt_interval=0 train.log_interval=1)

part env 60 bash -c "nvidia-smi -L; $py -c 'import torch, transformers; print(torch.__version__, torch.version.cuda, \
transformers.__version__, torch.cuda.get_device_name(), torch.cuda.is_available())'"
part cuda_tests 120 $py -m pytest -q -p no:cacheprovider tests/test_nf4.py

part tiny_cpu_fp32 180 "${train[@]}" train.out_dir="$out/tiny-cpu" --config configs/tiny.yaml train.device=cpu train.max_steps=20
part tiny_cuda_fp32 180 "${train[@]}" train.out_dir="$out/tiny-cuda" --config configs/tiny.yaml train.device=cuda train.max_steps=20
part tiny_cpu_vs_cuda 30 $py - "$out/tiny-cpu/metrics.jsonl" "$out/tiny-cuda/metrics.jsonl" <<'EOF'
import json, sys
runs = [{r["step"]: r["loss"] for r in map(json.loads, open(f)) if "loss" in r} for f in sys.argv[1:]]
steps = sorted(set(runs[0]) & set(runs[1]))
rel = [abs(runs[0][s] - runs[1][s]) / abs(runs[0][s]) for s in steps]
print("step  cpu fp32  cuda fp32  rel diff")
for s, d in zip(steps, rel):
    print(f"{s:4d}  {runs[0][s]:.6f}  {runs[1][s]:.6f}  {d:.2e}")
print(f"max relative difference over {len(steps)} steps: {max(rel):.2e}")
EOF
part tiny_cuda_bf16_compile 300 "${train[@]}" train.out_dir="$out/tiny-bf16" --config configs/tiny.yaml train.device=cuda \
  train.precision=bf16 train.compile=true train.max_steps=40
part tiny_bf16_metrics 30 $py - "$out/tiny-bf16/metrics.jsonl" <<'EOF'
import json, sys
recs = [json.loads(line) for line in open(sys.argv[1])]
start = next(r for r in recs if r.get("event") == "start")
print({k: start.get(k) for k in ("sdpa_kernel", "device_name", "precision", "flops_per_token") if k in start})
last = [r for r in recs if "loss" in r][-1]
print({k: last.get(k) for k in ("step", "loss", "tokens_per_s", "mfu", "peak_memory_bytes") if k in last})
EOF
part torchrun_nccl 240 $py -m torch.distributed.run --standalone --nproc-per-node 1 -m dist_llm.train \
  --config configs/tiny.yaml train.out_dir="$out/tiny-nccl" train.device=auto train.max_steps=10 \
  train.eval_interval=0 train.ckpt_interval=5 train.log_interval=5
part moe_layer 180 $py scripts/bench_moe_gpu.py
part moe_bf16_train 240 "${train[@]}" train.out_dir="$out/moe-bf16" --config configs/moe.yaml train.device=cuda train.precision=bf16 \
  train.max_steps=30
if [ "$bench" != "--no-bench" ]; then
  part bench_gpu 420 $py scripts/bench.py --scenario gpu --json "$out/bench-gpu.json"
fi
