"""The per-rank Estimate every count fills, which device its kernels are counted for, and how `dist-llm memory`
prints it (the table; --json is `Estimate.to_json`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from dist_llm.config import Config, ConfigError

GB, GiB = 1e9, 2**30


@dataclass
class Estimate:
    """Per-rank bytes. `model_states_bytes` = params + grads + master + optimizer; `peak_bytes` adds the
    activations held at once and the largest temporary buffer."""

    params_bytes: int = 0
    grads_bytes: int = 0
    master_bytes: int = 0
    optimizer_bytes: int = 0
    activation_bytes: int = 0
    temporary_bytes: int = 0
    pending_weight_bytes: int = 0
    """ZB-H1: the gradients its held-back W's keep from their B (pipeline.py), at the stage's peak."""
    offloaded: bool = False
    """Model states live in host memory (parallel.offload=cpu): not part of the device's peak."""
    init_transient_bytes: int = 0
    """Building the model: the largest piece of a parameter drawn in fp32 (one expert, or a chunk of rows:
    model/init.py) before a rank keeps its part; a whole parameter and its 16-bit copy under DeepSpeed's ZeRO-3,
    a whole block linear and its quantiser's working space under QLoRA; under native ZeRO-1/2 the fp32 model it
    casts into its flat buffer, or in fp32 on an accelerator the buffer beside it (`init_transient_bytes`)."""
    load_transient_bytes: int = 0
    """Loading weights (model.init_from, resume): the largest full tensor read in its source dtype and its fp32
    copy."""
    export_transient_bytes: int = 0
    """`convert --to-hf`/`--to-full`: the largest full tensor read from the checkpoint (fp32) and the copy written."""
    notes: list[str] = field(default_factory=list)
    moe: dict[str, int] | None = None
    """MoE models: the routed-token figures at the balanced and worst-case load (moe.py), by name."""
    moe_lines: list[str] = field(default_factory=list)

    @property
    def model_states_bytes(self) -> int:
        return self.params_bytes + self.grads_bytes + self.master_bytes + self.optimizer_bytes

    @property
    def peak_bytes(self) -> int:
        device_states = 0 if self.offloaded else self.model_states_bytes
        return device_states + self.activation_bytes + self.temporary_bytes + self.pending_weight_bytes

    @property
    def build_peak_bytes(self) -> int:
        """Building the model: the parameters and masters it keeps (on the device unless offloaded) and its
        transient; no gradient or optimizer state exists yet."""
        return (0 if self.offloaded else self.params_bytes + self.master_bytes) + self.init_transient_bytes

    def to_json(self) -> dict[str, Any]:
        return {"params_bytes": self.params_bytes, "grads_bytes": self.grads_bytes, "master_bytes": self.master_bytes,
                "optimizer_bytes": self.optimizer_bytes, "model_states_bytes": self.model_states_bytes,
                "activation_bytes": self.activation_bytes, "temporary_bytes": self.temporary_bytes,
                "pending_weight_bytes": self.pending_weight_bytes, "peak_bytes": self.peak_bytes,
                "host_bytes": self.model_states_bytes if self.offloaded else 0,
                "init_transient_bytes": self.init_transient_bytes, "build_peak_bytes": self.build_peak_bytes,
                "load_transient_bytes": self.load_transient_bytes,
                "export_transient_bytes": self.export_transient_bytes, **({"moe": self.moe} if self.moe else {})}


def _runs_on_gloo(cfg: Config) -> bool:
    device = cfg.train.device
    return device == "cpu" or (device == "auto" and not torch.cuda.is_available())


def assumed_device(cfg: Config) -> str:
    """Which device the prediction counts kernels for (RMSNorm's saved output, dropout masks, gloo's scratch),
    said beside it: with train.device=auto that is this machine's, so planning a GPU run on a CPU-only login
    node needs train.device=cuda."""
    if not _runs_on_gloo(cfg):
        return "counted for CUDA"
    if cfg.train.device == "auto":
        return "counted for the CPU (train.device=auto and no CUDA here; for a GPU run: train.device=cuda)"
    return "counted for the CPU"


# -- presentation ---------------------------------------------------------------------------------------------
def table(est: Estimate, title: str) -> str:
    rows = [("parameters", est.params_bytes), ("gradients", est.grads_bytes), ("fp32 master weights", est.master_bytes),
            ("optimizer states", est.optimizer_bytes), ("model states", est.model_states_bytes),
            ("activations", est.activation_bytes), ("largest temporary", est.temporary_bytes),
            *([("pending W gradients", est.pending_weight_bytes)] if est.pending_weight_bytes else []),
            ("peak", est.peak_bytes),
            ("init transient", est.init_transient_bytes), ("load transient", est.load_transient_bytes),
            ("export transient", est.export_transient_bytes)]
    lines = [title, f"{'per rank':<22}{'GB':>12}{'GiB':>12}", "-" * 46]
    for label, value in rows:
        lines.append(f"{label:<22}{value / GB:>12.3f}{value / GiB:>12.3f}")
    if est.init_transient_bytes or est.load_transient_bytes or est.export_transient_bytes:
        lines.append("transients: the largest whole tensor while building (native ZeRO-1/2 from model.init_from or "
                     "with PEFT: the model cast into its flat buffer), loading weights and exporting (besides the "
                     "model states; not in the training peak)")
    if est.moe:
        for label, key in (("activations, worst", "activation_bytes_worst"),
                           ("peak, worst routing", "peak_bytes_worst")):
            lines.append(f"{label:<22}{est.moe[key] / GB:>12.3f}{est.moe[key] / GiB:>12.3f}")
        lines += est.moe_lines
    lines += [f"note: {n}" for n in est.notes]
    return "\n".join(lines)


def parse_size(text: str) -> int:
    """'80GiB', '80GB', '40e9' -> bytes."""
    units = {"gib": GiB, "gb": GB, "mib": 2**20, "mb": 1e6, "tib": 2**40, "tb": 1e12}
    low = text.strip().lower()
    for unit, factor in sorted(units.items(), key=lambda kv: -len(kv[0])):
        if low.endswith(unit):
            return int(float(low[: -len(unit)]) * factor)
    try:
        return int(float(low))
    except ValueError:
        raise ConfigError(f"--gpu-memory: expected a size such as 80GiB or 40GB, got {text!r}") from None
