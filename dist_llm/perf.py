"""Measurements of speed shared by the trainer and the benchmark scripts.

- the device's peak FLOP/s, measured with a large matmul (MFU is quoted against it);
- model FLOPs utilisation: tokens/s x `GPT.flops_per_token` / peak;
- a process's peak memory: CUDA's allocator high-water mark, or on the CPU the peak resident set;
- which kernel scaled_dot_product_attention really runs (flash, memory-efficient, cuDNN, or the unfused
  math fallback), read from the aten op SDPA dispatches to.
"""

from __future__ import annotations

import ctypes
import re
import resource
import sys
import time
from contextlib import nullcontext

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (a timing boundary); nothing to wait for on the CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# -- FLOPs --------------------------------------------------------------------------------------------------
def measure_peak_flops(device: torch.device, dtype: torch.dtype = torch.bfloat16, *, n: int | None = None,
                       repeats: int = 10, rounds: int = 3) -> float:
    """FLOP/s of an n x n x n matmul in `dtype` on `device`, the best of `rounds` timings of `repeats` each.

    On a GPU a large bf16 matmul runs near the tensor cores' real peak (an H100 SXM reaches about 75-80% of its
    989 TFLOP/s datasheet figure), which makes it the honest denominator for MFU on the machine at hand."""
    n = n or (8192 if device.type == "cuda" else 1024)
    # its own generator: the global one's next draws are dropout's, which a resumed run must repeat exactly (the
    # fit measures after a resume restored the RNG)
    generator = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, device=device, dtype=dtype, generator=generator)
    b = torch.randn(n, n, device=device, dtype=dtype, generator=generator)
    for _ in range(2):
        torch.mm(a, b)
    best = float("inf")
    for _ in range(rounds):
        synchronize(device)
        start = time.perf_counter()
        for _ in range(repeats):
            torch.mm(a, b)
        synchronize(device)
        best = min(best, time.perf_counter() - start)
    return 2.0 * n**3 * repeats / best


def mfu(tokens_per_s: float, flops_per_token: float, peak_flops: float) -> float:
    """Model FLOPs utilisation: the share of the peak that the model's own FLOPs (no recomputation) use."""
    return tokens_per_s * flops_per_token / peak_flops


# -- memory -------------------------------------------------------------------------------------------------
def _proc_status_bytes(field: str) -> int | None:
    """A kB figure of Linux's /proc/self/status (VmRSS, VmHWM) in bytes; None elsewhere."""
    try:
        with open("/proc/self/status") as f:
            found = re.search(rf"^{field}:\s+(\d+) kB$", f.read(), re.MULTILINE)
    except OSError:
        return None
    return int(found.group(1)) * 1024 if found else None


def memory_bytes(device: torch.device) -> int:
    """What this process holds now: CUDA tensor bytes (`memory_allocated`), or on the CPU the resident set."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device)
    return _proc_status_bytes("VmRSS") or 0


def peak_memory_bytes(device: torch.device) -> int:
    """This process's peak since the last `reset_peak_memory`: on CUDA the bytes the caching allocator had
    handed out (`max_memory_allocated`), on the CPU the peak resident set (Linux's VmHWM)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    peak = _proc_status_bytes("VmHWM")
    if peak is not None:
        return peak
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # (bytes on macOS, KiB elsewhere)


def reset_peak_memory(device: torch.device) -> bool:
    """Start a new peak: CUDA's allocator statistics; on the CPU, Linux's VmHWM (writing 5 to
    /proc/self/clear_refs), after handing the heap's free pages back to the system (glibc's malloc_trim).
    Without the trim, tensors freed before would leave pages resident that later ones reuse unseen, and a peak
    measured after another workload in the same process would miss them. False where the host's peak could
    not be reset (no writable /proc/self/clear_refs): a later peak then covers the whole process."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return True
    _trim_heap()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:  # not Linux: ru_maxrss cannot be reset, the peak then covers the whole process
        return False
    return True


def _trim_heap() -> None:
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


# -- attention kernels ----------------------------------------------------------------------------------------
#: the aten ops SDPA dispatches to, by the kernel's name; none of them means the unfused math path
SDPA_KERNELS = {
    "_scaled_dot_product_flash_attention": "flash",
    "_scaled_dot_product_efficient_attention": "efficient",
    "_scaled_dot_product_cudnn_attention": "cudnn",
    "_scaled_dot_product_flash_attention_for_cpu": "flash-cpu",
    "_scaled_dot_product_fused_attention_overrideable": "fused",
}
FUSED_CUDA_KERNELS = ("flash", "efficient", "cudnn")


class _OpNames(TorchDispatchMode):
    """Records the aten ops that run below autograd."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.names.append(func._overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def sdpa_kernel(attention: nn.Module, *, seq: int, dtype: torch.dtype, device: torch.device, batch: int = 1) -> str:
    """The kernel `attention.core` (our Attention) runs on q, k, v of `seq` tokens in `dtype` under the same
    autocast as training, with gradients on: 'flash', 'efficient', 'cudnn', 'flash-cpu', or 'math'.

    SDPA picks its kernel per call from the inputs (dtype, head size, mask, dropout, GQA, the GPU), silently
    falling back to math, which materialises the T x T scores; this runs one call and reads which it took.
    The random streams are restored, so a training run draws the same numbers with or without the check."""
    heads, kv_heads, head_dim = attention.n_head, attention.n_kv_head, attention.head_dim
    cuda = [device.index if device.index is not None else torch.cuda.current_device()] if device.type == "cuda" else []
    lower = dtype in (torch.bfloat16, torch.float16)
    autocast = torch.autocast(device_type=device.type, dtype=dtype) if lower else nullcontext()
    with torch.random.fork_rng(devices=cuda), autocast:
        q = torch.randn(batch, heads, seq, head_dim, device=device, dtype=dtype, requires_grad=True)
        k = torch.randn(batch, kv_heads, seq, head_dim, device=device, dtype=dtype, requires_grad=True)
        v = torch.randn(batch, kv_heads, seq, head_dim, device=device, dtype=dtype, requires_grad=True)
        with _OpNames() as ops:
            attention.core(q, k, v)
    for name in ops.names:
        if name in SDPA_KERNELS:
            return SDPA_KERNELS[name]
    return "math"
