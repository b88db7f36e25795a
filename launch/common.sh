# Sourced by the launch scripts.
# NPROC: processes per node, default the GPUs nvidia-smi lists, else 1 (a CPU machine).
if [ -z "${NPROC:-}" ]; then
  NPROC=$(nvidia-smi -L 2>/dev/null | wc -l || true)
  [ "${NPROC:-0}" -gt 0 ] || NPROC=1
fi
# torchrun's agent would otherwise keep one TCPStore for every restart, and a worker restarted on another
# node than the failed one would read stale addresses (pytorch/pytorch#135712): one store per attempt.
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-1}
