# Sourced by the launch scripts.
# NPROC: processes per node, default the GPUs nvidia-smi lists, else 1 (a CPU machine).
if [ -z "${NPROC:-}" ]; then
  NPROC=$(nvidia-smi -L 2>/dev/null | wc -l || true)
  [ "${NPROC:-0}" -gt 0 ] || NPROC=1
fi
