"""The ds_config `parallel.backend=deepspeed` hands DeepSpeed's engine: derived from ours (batch sizes, ZeRO stage,
precision, clipping, bucket sizes), so users who know DeepSpeed switch with one key, with the JSON of
`parallel.deepspeed_config` merged over it. Where both set a key our config decides they must agree, and keys that
move or re-lay-out the partitions, which dist_llm's checkpoints do not follow, are refused (one line each)."""

from __future__ import annotations

import json
import math
from typing import Any

from dist_llm.config import Config, ConfigError


def deepspeed_config(cfg: Config, dp: int) -> dict[str, Any]:
    t, p = cfg.train, cfg.parallel
    accum = t.global_batch_size // (t.micro_batch_size * dp)
    return {
        "train_batch_size": t.global_batch_size,
        "train_micro_batch_size_per_gpu": t.micro_batch_size,
        "gradient_accumulation_steps": accum,
        "gradient_clipping": cfg.optim.grad_clip,
        "zero_optimization": {"stage": p.zero_stage, "reduce_bucket_size": int(p.bucket_mb * 2**20 / 4),
                              "allgather_bucket_size": int(p.bucket_mb * 2**20 / 4)},
        "bf16": {"enabled": t.precision == "bf16"},
        "fp16": {"enabled": t.precision == "fp16", "initial_scale_power": int(math.log2(t.loss_scale_init)),
                 "loss_scale_window": 2000},
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }


#: ds_config keys that our config also decides: (path in the JSON, our key, our value from the derived config)
_AGREE = [("train_batch_size", "train.global_batch_size"), ("train_micro_batch_size_per_gpu", "train.micro_batch_size"),
          ("gradient_accumulation_steps", "train.global_batch_size / (train.micro_batch_size * dp)"),
          ("gradient_clipping", "optim.grad_clip"), ("zero_optimization.stage", "parallel.zero_stage"),
          ("bf16.enabled", "train.precision"), ("fp16.enabled", "train.precision")]


def _get(tree: dict[str, Any], path: str) -> Any:
    for key in path.split("."):
        if not isinstance(tree, dict) or key not in tree:
            return None
        tree = tree[key]
    return tree


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in extra.items():
        if v == "auto":  # DeepSpeed's "fill in from elsewhere": ours fills it
            continue
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


#: ds_config keys that move or re-lay-out the partitions, which the chunk save and resume (deepspeed_shards.py)
#: do not follow: (path in the JSON, whether a given value is refused, why)
_REFUSED = [("zero_optimization.offload_optimizer.device", lambda v: v == "nvme", "optimizer state on NVMe"),
            ("zero_optimization.offload_param.device", lambda v: v == "nvme", "parameters on NVMe"),
            ("zero_optimization.mics_shard_size", lambda v: isinstance(v, int) and v > 0, "MiCS's sub-group shards"),
            ("zero_optimization.zero_quantized_weights", bool, "quantised weight partitions"),
            ("zero_optimization.zero_quantized_nontrainable_weights", bool, "quantised frozen-weight partitions"),
            ("zero_optimization.zero_quantized_gradients", bool, "quantised gradient partitions")]
_FP32 = ("fp32", "float32", "float", "torch.float32")


def _refuse_unsupported(theirs: dict[str, Any], merged: dict[str, Any], where: str) -> None:
    """One line naming the first ds_config key whose partitions dist_llm's checkpoints cannot hold."""
    for ds_key, refused, what in _REFUSED:
        value = _get(theirs, ds_key)
        if value is not None and refused(value):
            raise ConfigError(f"parallel.deepspeed_config: {where} sets {ds_key}={value!r} ({what}), which "
                              f"dist_llm's checkpoints cannot save or resume; remove it or use parallel.backend=native")
    accum = _get(theirs, "data_types.grad_accum_dtype")
    offload = _get(merged, "zero_optimization.offload_optimizer.device") in ("cpu", "nvme")
    if (isinstance(accum, str) and accum.lower() in _FP32 and _get(merged, "bf16.enabled")
            and _get(merged, "zero_optimization.stage") == 1 and not offload):
        raise ConfigError(f"parallel.deepspeed_config: {where} sets data_types.grad_accum_dtype={accum!r}, which makes "
                          f"DeepSpeed use its BF16_Optimizer, whose partitions dist_llm cannot checkpoint; remove it "
                          f"(dist_llm's ZeRO keeps fp32 accumulation via parallel.grad_accum_dtype) or use "
                          f"parallel.backend=native")


def merged_deepspeed_config(cfg: Config, dp: int) -> dict[str, Any]:
    """Our derived ds_config, with `parallel.deepspeed_config` merged over it; where both set a key that our
    config decides, they must agree (a contradiction is a one-line error naming both keys)."""
    from pathlib import Path

    ours = deepspeed_config(cfg, dp)
    path = cfg.parallel.deepspeed_config
    if not path:
        return ours
    try:
        theirs = json.loads(Path(path).expanduser().read_text())
    except (OSError, ValueError, RecursionError) as e:
        raise ConfigError(f"parallel.deepspeed_config: cannot read {path}: {str(e).splitlines()[0][:200]}") from None
    if not isinstance(theirs, dict):
        raise ConfigError(f"parallel.deepspeed_config: {path} must hold a JSON object")
    for ds_key, our_key in _AGREE:
        given, derived = _get(theirs, ds_key), _get(ours, ds_key)
        if given is not None and given != "auto" and given != derived:
            raise ConfigError(f"parallel.deepspeed_config: {path} sets {ds_key}={given!r} but {our_key} gives "
                              f"{derived!r}; change one of them")
    merged = _merge(ours, theirs)
    _refuse_unsupported(theirs, merged, path)
    return merged
