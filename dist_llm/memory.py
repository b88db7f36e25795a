"""How much memory a rank needs: model states (parameters, gradients, master weights, optimizer states),
activations and the largest temporary buffers, for any config and layout.

Two models live here.

* The ZeRO paper's (Rajbhandari et al. 2020), for a parameter count alone (`paper_model_states`): mixed
  precision keeps 2 bytes of fp16 parameters and 2 of gradients per parameter, and K = 12 bytes of optimizer
  states (a 4-byte fp32 master copy plus Adam's two 4-byte moments); stage 1 shards the K bytes over the dp
  ranks, stage 2 the gradients too, stage 3 everything.

* Our own implementation's, exactly (`predict`): each parameter's local shape after tensor parallelism
  (whole heads of the fused QKV, column rows, row columns, vocabulary rows), the blocks of this rank's
  pipeline stage, PEFT's frozen base (QLoRA's in 4-bit NF4), then what each data-parallel form holds:
    none / DDP / flat all-reduce   fp32 parameters and gradients, Adam moments (8 B) for trainable ones
    ZeRO-1/2 (ours)                a flat buffer of all trainable parameters in the compute dtype, bucket-
                                   padded to dp; gradients in parallel.grad_accum_dtype (fp32 by default):
                                   stage 1 a full buffer, stage 2 a 1/dp shard plus two reused bucket buffers
                                   in the compute dtype (at most two buckets in flight); fp32 master and
                                   moments for the rank's shard (master only in mixed runs)
    ZeRO-3 (FSDP2)                 fp32 parameter, gradient and moment shards: dim 0 split in dp chunks;
                                   gradients are reduce-scattered every micro-step, so no unsharded gradient
                                   outlives a micro-step's backward under accumulation
    DeepSpeed ZeRO-1/2             as DeepSpeed's own estimator counts them (`_deepspeed_zero_states`): 16-bit
                                   parameters, a gradient partition and its fp32 copy, fp32 master and moments
  plus PyTorch's 4-byte `step` tensor per optimizer tensor. Tests check these against the bytes a training
  rank really holds.

Activations follow Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer
Models"): per layer, in 16-bit, s*b*h*(34 + 5*a*s/h) bytes without recomputation, divided by t with tensor
plus sequence parallelism, 34*s*b*h/t with selective recomputation (the a*s*s attention scores dropped),
2*s*b*h with full recomputation (`korthikanti_layer_bytes`). Our kernels hold less and somewhat different
tensors, so `predict` counts what our GPT really saves for backward (`our_layer_values`): SDPA's flash and
memory-efficient kernels never store the a*s*s scores or the softmax dropout mask (only a log-sum-exp per
head and token), so selective recomputation saves almost nothing here; RoPE keeps rotated copies of q and
k; RMSNorm keeps its normalised output besides its input where it runs PyTorch's composite (the CPU), not on a
GPU, whose fused kernel keeps its input and statistics only (`rms_norm_saves_normalised`); with sequence parallelism
a column-parallel layer keeps the all-gathered input (b*s*h, not b*s*h/t), as a plain F.linear does.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Iterable

import torch

from dist_llm import memory_moe, memory_pipeline
from dist_llm.config import Config, ConfigError, reshard_after_forward

GB, GiB = 1e9, 2**30
PAPER_K = 12


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
    """ZB-H1: the gradients its held-back W's keep from their B (memory_pipeline), at the stage's peak."""
    offloaded: bool = False
    """Model states live in host memory (parallel.offload=cpu): not part of the device's peak."""
    init_transient_bytes: int = 0
    """Building the model: the largest piece of a parameter drawn in fp32 (one expert, or a chunk of rows:
    model/init.py) before a rank keeps its part; a whole parameter and its 16-bit copy under DeepSpeed's ZeRO-3,
    a whole block linear and its quantiser's working space under QLoRA (`init_transient_bytes`)."""
    load_transient_bytes: int = 0
    """Loading weights (model.init_from, resume): the largest full tensor read in its source dtype and its fp32
    copy."""
    export_transient_bytes: int = 0
    """`convert --to-hf`/`--to-full`: the largest full tensor read from the checkpoint (fp32) and the copy written."""
    notes: list[str] = field(default_factory=list)
    moe: dict[str, int] | None = None
    """MoE models: the routed-token figures at the balanced and worst-case load (memory_moe), by name."""
    moe_lines: list[str] = field(default_factory=list)

    @property
    def model_states_bytes(self) -> int:
        return self.params_bytes + self.grads_bytes + self.master_bytes + self.optimizer_bytes

    @property
    def peak_bytes(self) -> int:
        device_states = 0 if self.offloaded else self.model_states_bytes
        return device_states + self.activation_bytes + self.temporary_bytes + self.pending_weight_bytes

    def to_json(self) -> dict[str, Any]:
        return {"params_bytes": self.params_bytes, "grads_bytes": self.grads_bytes, "master_bytes": self.master_bytes,
                "optimizer_bytes": self.optimizer_bytes, "model_states_bytes": self.model_states_bytes,
                "activation_bytes": self.activation_bytes, "temporary_bytes": self.temporary_bytes,
                "pending_weight_bytes": self.pending_weight_bytes, "peak_bytes": self.peak_bytes,
                "host_bytes": self.model_states_bytes if self.offloaded else 0,
                "init_transient_bytes": self.init_transient_bytes, "load_transient_bytes": self.load_transient_bytes,
                "export_transient_bytes": self.export_transient_bytes, **({"moe": self.moe} if self.moe else {})}


# -- the ZeRO paper ---------------------------------------------------------------------------------------
def paper_model_states(params: float, dp: int, zero_stage: int, precision: str = "mixed") -> Estimate:
    """Model states per rank for `params` parameters, as the ZeRO paper counts them (no padding, no steps)."""
    if zero_stage not in (0, 1, 2, 3):
        raise ConfigError(f"--zero-stage: must be 0, 1, 2 or 3, got {zero_stage}")
    if precision not in ("mixed", "fp32"):
        raise ConfigError(f"--precision: must be mixed or fp32, got {precision}")
    p, g, master, opt = (2.0, 2.0, 4.0, 8.0) if precision == "mixed" else (4.0, 4.0, 0.0, 8.0)
    if zero_stage >= 1:
        master, opt = master / dp, opt / dp
    if zero_stage >= 2:
        g /= dp
    if zero_stage >= 3:
        p /= dp
    return Estimate(params_bytes=round(p * params), grads_bytes=round(g * params), master_bytes=round(master * params),
                    optimizer_bytes=round(opt * params))


# -- activations: the paper's formulas and ours --------------------------------------------------------------
def korthikanti_layer_bytes(s: int, b: int, h: int, a: int, t: int = 1, *, sequence_parallel: bool = False,
                            recompute: str = "none") -> float:
    """Activation bytes of one transformer layer in 16-bit, Korthikanti et al. 2022 (Table 2)."""
    if recompute == "full":
        return 2 * s * b * h / (t if sequence_parallel else 1)
    if recompute == "selective":
        return 34 * s * b * h / t if sequence_parallel else s * b * h * (10 + 24 / t)
    if sequence_parallel:
        return s * b * h * (34 + 5 * a * s / h) / t
    return s * b * h * (10 + 24 / t + 5 * a * s / (h * t))


def our_layer_values(cfg: Config, tp: int, *, sequence_parallel: bool) -> tuple[float, float]:
    """Values a block of our GPT saves for backward per token: (16-bit-able values, fp32 values). The first
    are matmul outputs that autocast computes in the compute dtype; the second stay fp32 in mixed precision
    (the residual stream, norm statistics, the attention log-sum-exp). A linear keeps its input only when
    its weight is trained or carries LoRA; a frozen base (PEFT) keeps less."""
    m, f = cfg.model, cfg.peft
    c, hd = m.n_embd, m.head_dim
    q, kv = m.n_head * hd / tp, (m.kv_heads * hd / tp if m.kv_heads >= tp else hd)
    seq = tp if sequence_parallel else 1
    rms = m.norm == "rmsnorm"
    lora = set(f.targets) if f.method in ("lora", "qlora") else set()
    trained = {"qkv", "attn_out", "mlp_up", "mlp_down"} if f.method == "none" else lora
    # per norm: its input (the residual, a 1/t slice of the tokens under SP) and statistics (LayerNorm keeps
    # mean and rstd, RMSNorm rstd, and on the CPU its normalised output)
    norm_in = c / seq + (c / seq if rms_norm_saves_normalised(cfg) else 0)
    norm_stats = (1 if rms else 2) / seq
    low = q + 2 * kv  # the fused qkv output (q, k, v are views of it), kept by attention
    # the normalised input of qkv: under SP only the local slice, all-gathered again in backward (Megatron's way)
    low += c / seq if "qkv" in trained else 0
    if m.pos_emb == "rope":
        low += q + kv  # rotated q and k, new tensors
    low += q  # attention output: kept by the attention kernel, and the projection's input
    low += sum(1 for x in lora if x in ("qkv", "attn_out")) * f.rank  # each LoRA's A x, the input of B
    low += _mlp_low_values(cfg, tp, seq)
    if f.method == "adapter":  # after attention and MLP: its input, the bottleneck, and its activation
        low += 2 * (c / seq + 2 * f.rank)
    high = 2 * norm_in + 2 * norm_stats + m.n_head / tp  # log-sum-exp per head
    return low, high


def rms_norm_saves_normalised(cfg: Config) -> bool:
    """Whether each RMSNorm keeps its normalised output x * rstd for backward, besides its input and rstd.

    nn.RMSNorm calls aten's rms_norm, which runs `_fused_rms_norm`: on CUDA (and XPU) a fused kernel whose backward
    takes the input, rstd and weight (derivatives.yaml), nothing else; elsewhere (the CPU) its composite,
    pow -> mean -> rsqrt -> mul(x, rstd) -> mul(., weight), whose last product keeps x * rstd for the weight's
    gradient, so only where that weight trains: PEFT freezes the norms (autograd then saves no input of a product
    for a factor that needs no gradient). On an H200 (torch 2.11) configs/tiny.yaml fp32 saved 18.00 MiB less
    than on the CPU, and moe.yaml bf16 18.00 MiB less: one (B, T, C) fp32 tensor for each of the 9 norms (4
    blocks x 2 and the final one); the SDPA kernels (efficient, cuDNN, flash-cpu) save the same q, k, v, output
    and log-sum-exp there. Which device: train.device, or with "auto" whether CUDA is present here, as the
    trainer picks it. Torch without `_fused_rms_norm_backward` (before its CUDA kernel) runs the composite
    everywhere."""
    if cfg.model.norm != "rmsnorm" or cfg.peft.method != "none":
        return False
    return _runs_on_gloo(cfg) or not hasattr(torch.ops.aten, "_fused_rms_norm_backward")


def _mlp_low_values(cfg: Config, tp: int, seq: int = 1) -> float:
    """The dense MLP's part of `our_layer_values`' 16-bit values (an MoE block has memory_moe's instead): its
    normalised input (1/seq of it: under SP the local slice), its hidden values, the down projection's input,
    its LoRAs' A x."""
    m, f = cfg.model, cfg.peft
    hidden = m.ffn_hidden / tp
    lora = set(f.targets) if f.method in ("lora", "qlora") else set()
    trained = {"qkv", "attn_out", "mlp_up", "mlp_down"} if f.method == "none" else lora
    gated = m.mlp == "swiglu"
    low = m.n_embd / seq if "mlp_up" in trained else 0  # the normalised input of mlp.up (and gate: one for both)
    low += 3 * hidden if gated else hidden  # gate, silu, up / up: kept by the activation (and the product)
    low += hidden if "mlp_down" in trained else 0  # the down projection's input
    low += sum({"mlp_up": 2 if gated else 1, "mlp_down": 1}.get(x, 0) for x in lora) * f.rank
    return low


def _params16(cfg: Config, dp: int) -> bool:
    """Parameters held in the compute dtype: our ZeRO-1/2 (with fp32 masters), DeepSpeed at every stage."""
    return cfg.parallel.backend == "deepspeed" or (dp > 1 and cfg.parallel.zero_stage in (1, 2))


def _layer_bytes(cfg: Config, *, tp: int, dp: int, sequence_parallel: bool) -> float:
    """Bytes per token one block saves. In mixed precision matmul outputs are 16-bit; the residual stream
    stays fp32 unless the parameters themselves are 16-bit (our ZeRO-1/2 keep them so, with fp32 masters)."""
    low, high = our_layer_values(cfg, tp, sequence_parallel=sequence_parallel)
    dropout = _lora_dropout_bytes(cfg, cfg.peft.targets, tp=tp, dp=dp, seq=tp if sequence_parallel else 1)
    if cfg.train.precision == "fp32":
        return 4 * (low + high) + dropout
    # our ZeRO-1/2 keep 16-bit parameters; DeepSpeed casts the whole module to bf16/fp16 at every stage
    params16 = _params16(cfg, dp)
    fp32_stats = (cfg.model.n_head / tp) + 2 * ((1 if cfg.model.norm == "rmsnorm" else 2)
                                                / (tp if sequence_parallel else 1))
    return 2 * low + (2 * (high - fp32_stats) if params16 else 4 * (high - fp32_stats)) + 4 * fp32_stats + dropout


def _moe_layer_bytes(cfg: Config, *, tp: int, dp: int, sequence_parallel: bool, worst: bool = False) -> float:
    """Bytes per token an MoE block saves: the dense block's without its MLP, plus router, routed and shared
    experts (memory_moe) for one micro-batch, at the balanced or the worst-case load."""
    tokens = cfg.train.micro_batch_size * cfg.model.block_size
    dense = _layer_bytes(cfg, tp=tp, dp=dp, sequence_parallel=sequence_parallel)
    mlp = (4 if cfg.train.precision == "fp32" else 2) * _mlp_low_values(cfg, tp) + _lora_dropout_bytes(
        cfg, {"mlp_up", "mlp_down"} & set(cfg.peft.targets), tp=tp, dp=dp, seq=tp if sequence_parallel else 1)
    # (under tp each rank routes its 1/tp of the tokens through whole experts: parallel/tensor/moe.py)
    moe = memory_moe.moe_block_bytes(cfg, tokens // tp, memory_moe.ep_degree(cfg), params16=_params16(cfg, dp),
                                     worst=worst)
    return dense - mlp + moe / tokens


def _head_values(cfg: Config, tp: int, *, sequence_parallel: bool) -> float:
    """Values per token saved by the final norm, the LM head and the loss (fp32), and the embedding's ids."""
    m = cfg.model
    seq = tp if sequence_parallel else 1
    rms = m.norm == "rmsnorm"
    vocab = m.padded_vocab / tp
    norm = m.n_embd / seq * (2 if rms_norm_saves_normalised(cfg) else 1) + (1 if rms else 2) / seq
    # a frozen head needs no input for its gradient; under SP the head keeps its input's local slice
    head_input = m.n_embd / seq if cfg.peft.method == "none" else 0
    return norm + head_input + vocab + 2  # norm, head input, log-softmax (or softmax) over the vocabulary, ids


def _blocks(cfg: Config, pp: int, pp_rank: int) -> list[int] | range:
    """The blocks of this pipeline stage."""
    return _stage_layers(cfg, pp, pp_rank) if pp > 1 else range(cfg.model.n_layer)


def _in_flight(cfg: Config, *, pp: int, pp_rank: int, dp: int) -> float:
    """Micro-batches whose activations a stage holds at once: all of them with GPipe, pp - rank with 1F1B, p
    with ZB-H1, with interleaving the schedule's peak of chunk forwards over v."""
    t = cfg.train
    micro = t.global_batch_size // (t.micro_batch_size * dp)
    p = cfg.parallel
    if pp == 1:
        return 1
    if p.pp_schedule == "gpipe":
        return micro
    if p.pp_schedule == "zb1":  # a held-back W keeps its micro-batch: every stage up to the first's p
        return min(micro, pp)
    if p.pp_schedule == "interleaved" and micro % pp == 0:  # chunk forwards at the peak, each 1/v of the blocks
        from dist_llm.parallel.pipeline.schedule import interleaved, peak_in_flight

        return peak_in_flight(interleaved(pp, micro, p.pp_virtual)[pp_rank]) / p.pp_virtual
    return min(micro, pp - pp_rank)


def _values_bytes(cfg: Config, dp: int, low: float, norm: float = 0.0, fp32: float = 0.0) -> float:
    """Bytes of values per token as `_layer_bytes` sizes them: matmul outputs (`low`, 16-bit in mixed precision),
    norm inputs (`norm`, 16-bit only with 16-bit parameters), statistics and log-sum-exps (`fp32`)."""
    if cfg.train.precision == "fp32":
        return 4 * (low + norm + fp32)
    return 2 * low + (2 if _params16(cfg, dp) else 4) * norm + 4 * fp32


def _lora_dropout_bytes(cfg: Config, targets: Iterable[str], *, tp: int, dp: int, seq: int,
                        masks_only: bool = False) -> float:
    """Bytes per token the dropout of the LoRAs on `targets` keeps (peft.dropout > 0, inputs that need a gradient):
    its mask, a bool an element on CUDA (the fused kernel's, by derivatives.yaml; not yet measured on a GPU), on
    the CPU a tensor of the input's dtype (dropout there multiplies by a scaled noise tensor, which the product
    keeps): the norm outputs that qkv and mlp_up read are
    fp32 unless the parameters are 16-bit, the others the compute dtype. Each A then keeps the dropped copy of its
    input instead of the input: a copy more where something else keeps the input too (attn_out's, which the
    attention keeps as its output; the second of a gated MLP's up and gate LoRAs, which share it without
    dropout). `masks_only`: the masks alone."""
    f, m = cfg.peft, cfg.model
    if f.method not in ("lora", "qlora") or f.dropout == 0:
        return 0.0
    gated = m.mlp == "swiglu"
    cuda = not _runs_on_gloo(cfg)
    width = {"qkv": m.n_embd / seq, "attn_out": m.n_head * m.head_dim / tp,
             "mlp_up": (2 if gated else 1) * m.n_embd / seq, "mlp_down": m.ffn_hidden / tp}
    out = 0.0
    for t in set(targets) & width.keys():
        norm_input = t in ("qkv", "mlp_up")
        size = 4 if cfg.train.precision == "fp32" or (norm_input and not _params16(cfg, dp)) else 2
        out += width[t] * (1 if cuda else size)
        if t == "mlp_up" and gated and not masks_only:  # (the second A's own dropped input)
            out += _values_bytes(cfg, dp, m.n_embd / seq)
        if t == "attn_out" and not masks_only:  # (the dropped copy of the attention's output)
            out += _values_bytes(cfg, dp, width[t])
    return out


def _first_block_unsaved_bytes(cfg: Config, *, tp: int, dp: int, sequence_parallel: bool) -> float:
    """Bytes per token that block 0 does not save under LoRA/QLoRA, against `_layer_bytes`. PEFT freezes the
    embeddings and the norms, so the residual stream entering block 0 needs no gradient, and autograd keeps
    nothing for an op none of whose inputs needs one: every value before the first LoRA of the block (qkv, then
    attn_out, mlp_up, mlp_down, in the order the block runs them) goes unsaved, and that LoRA's dropout keeps no
    mask. The LoRA's A keeps its input whatever (counted in `our_layer_values`); after it the stream needs a
    gradient again and the rest of the model saves as counted. Checked against the activation meter for each
    first target (tests/test_memory.py). Not taken off (an upper bound there): a first block that holds no LoRA,
    or is MoE with none on its attention, adapters (whose first input needs no gradient either), full activation
    checkpointing (which keeps block inputs instead). Only the first pipeline stage holds block 0."""
    f, m = cfg.peft, cfg.model
    lora = set(f.targets) if f.method in ("lora", "qlora") else set()
    order = [t for t in ("qkv", "attn_out", "mlp_up", "mlp_down") if t in lora]
    if not order or (m.is_moe_block(0) and order[0] not in ("qkv", "attn_out")):
        return 0.0  # (an MoE block's attention is a dense block's; its MLP part is memory_moe's)
    first = order[0]
    seq = tp if sequence_parallel else 1
    rms = m.norm == "rmsnorm"
    q, kv = m.n_head * m.head_dim / tp, (m.kv_heads * m.head_dim / tp if m.kv_heads >= tp else m.head_dim)
    norm_in = m.n_embd / seq  # (as `our_layer_values`: its input; a frozen RMSNorm keeps no normalised output)
    stats = (1 if rms else 2) / seq
    low, norm, fp32 = 0.0, norm_in, stats  # ln_1
    if first != "qkv":  # attention: q, k, v (and RoPE's rotated q, k), the log-sum-exp; its output unless kept
        low += q + 2 * kv + (q + kv if m.pos_emb == "rope" else 0) + (q if first != "attn_out" else 0)
        fp32 += m.n_head / tp
    if first in ("mlp_up", "mlp_down"):
        norm, fp32 = norm + norm_in, fp32 + stats  # ln_2
    if first == "mlp_down":  # the activation's saved values (gate, silu, up / up)
        low += (3 if m.mlp == "swiglu" else 1) * m.ffn_hidden / tp
    # the first LoRA's dropout keeps no mask; attn_out's dropped copy is the only one (the attention keeps nothing)
    return (_values_bytes(cfg, dp, low, norm, fp32)
            + _lora_dropout_bytes(cfg, [first], tp=tp, dp=dp, seq=seq, masks_only=first != "attn_out"))


def activation_bytes(cfg: Config, *, tp: int, pp: int, pp_rank: int, dp: int, worst: bool = False,
                     cp: int = 1) -> int:
    """Peak bytes saved for backward on this rank: its stage's layers for the micro-batches in flight (MoE
    blocks at the balanced routed load, or with `worst` every ep rank's routed tokens on this one). A
    context-parallel rank holds block_size/cp tokens of each sequence, and saves only those (ring attention keeps
    its own q, k, v, output and log-sum-exp, no other rank's blocks)."""
    m, t, p = cfg.model, cfg.train, cfg.parallel
    sp = p.sequence_parallel and tp > 1
    tokens = t.micro_batch_size * m.block_size // cp
    layer = _layer_bytes(cfg, tp=tp, dp=dp, sequence_parallel=sp)
    blocks = _blocks(cfg, pp, pp_rank)
    layers = len(blocks)
    n_moe = sum(1 for i in blocks if m.is_moe_block(i))
    moe_layer = _moe_layer_bytes(cfg, tp=tp, dp=dp, sequence_parallel=sp, worst=worst) if n_moe else 0.0
    mode = t.activation_checkpointing
    if mode == "full":  # each block keeps its input (its recomputation in backward is a temporary)
        per_micro = layers * m.n_embd / (tp if sp else 1) * 4
    elif mode == "selective":  # only the attention core is recomputed: it held just the log-sum-exp
        per_micro = (layers - n_moe) * layer + n_moe * moe_layer - layers * m.n_head / tp * 4
    else:
        per_micro = (layers - n_moe) * layer + n_moe * moe_layer
    if pp_rank == 0 and mode != "full":
        per_micro -= _first_block_unsaved_bytes(cfg, tp=tp, dp=dp, sequence_parallel=sp)
    if pp_rank == pp - 1:
        per_micro += _head_values(cfg, tp, sequence_parallel=sp) * 4
    elif pp_rank == 0:
        per_micro += 2  # token ids
    in_flight = _in_flight(cfg, pp=pp, pp_rank=pp_rank, dp=dp)
    held = per_micro * in_flight
    if p.pp_schedule == "zb1" and pp > 1 and pp_rank == pp - 1:
        # a micro-batch past its B keeps the graph below its weight ops only: the loss's log-softmax and targets
        # above the LM head are freed at B (executor.py), so all but the one in its forward hold less (under PEFT
        # with a frozen head more is freed: an upper bound there)
        held -= (in_flight - 1) * (cfg.model.padded_vocab / tp + 2) * 4
    return round(held * tokens)


def _stage_layers(cfg: Config, pp: int, pp_rank: int) -> list[int]:
    """This stage's blocks, as `cut_to_stage` splits them (balanced by training FLOPs, or parallel.pp_layers;
    interleaved: its chunks' blocks)."""
    from dist_llm.parallel.pipeline.stage import stage_ranges

    # remembered per model and split: the search is the dearest part of counting a layout
    v = cfg.parallel.pp_virtual
    key = repr((cfg.model, pp, cfg.parallel.pp_layers, v))
    if key not in _RANGES:
        shapes = [(n, s) for n, s, _ in _model_params(cfg, peft=False)]
        _RANGES[key] = stage_ranges(cfg.model, pp * v, shapes, cfg.parallel.pp_layers or None)
    return [i for c in range(v) for i in _RANGES[key][c * pp + pp_rank]]


_RANGES: dict[str, list[range]] = {}


def _block_params(cfg: Config) -> int:
    key = repr(cfg.model)
    if key not in _BLOCK:
        _BLOCK[key] = sum(math.prod(s) for name, s, _ in _model_params(cfg, peft=False) if name.startswith("blocks.0."))
    return _BLOCK[key]


_BLOCK: dict[str, int] = {}


# (name, shape, requires_grad) of every parameter of the whole model, PEFT applied or not, built once on the meta
# device per model: `suggest` asks for hundreds of layouts of one model, and a build of a 1.3B GPT takes 0.2 s
_PARAMS: dict[str, list[tuple[str, tuple[int, ...], bool]]] = {}


def _model_params(cfg: Config, *, peft: bool = True) -> list[tuple[str, tuple[int, ...], bool]]:
    from dist_llm.model import GPT
    from dist_llm.peft import apply_peft

    # (QLoRA's trainable and frozen shapes are LoRA's; model_state_bytes counts its frozen weights in NF4 bytes)
    method = cfg.peft if cfg.peft.method != "qlora" else dataclasses.replace(cfg.peft, method="lora")
    key = repr((cfg.model, method if peft and method.method != "none" else None))
    if key not in _PARAMS:
        with torch.device("meta"):
            model = GPT(cfg.model)
            apply_peft(model, method if peft else dataclasses.replace(method, method="none"), seed=0)
        if len(_PARAMS) >= 16:
            _PARAMS.pop(next(iter(_PARAMS)))
        _PARAMS[key] = [(n, tuple(p.shape), p.requires_grad) for n, p in model.named_parameters()]
    return _PARAMS[key]


# -- model states, exactly as our data-parallel forms hold them ------------------------------------------------
def _local_shape(name: str, shape: tuple[int, ...], cfg: Config, tp: int) -> tuple[int, ...]:
    """This parameter's shape on tensor-parallel rank 0."""
    if tp == 1:
        return shape
    from dist_llm.parallel.tensor.plan import qkv_rows

    base, _, leaf = name.rpartition(".")
    lora = base.endswith(".lora")
    layer = base[: -len(".lora")] if lora else base
    kind = ("qkv" if layer.endswith("attn.qkv") else "column" if layer.endswith(("mlp.up", "mlp.gate"))
            else "row" if layer.endswith(("attn.proj", "mlp.down")) else "vocab" if layer in ("wte", "lm_head")
            else "whole")
    rows_split = kind in ("qkv", "column", "vocab")
    if lora:  # column layers: B split by rows, A whole; row layers: A split by columns, B whole
        if kind == "row" and leaf == "A":
            return shape[0], shape[1] // tp
        if rows_split and leaf == "B":
            rows = len(qkv_rows(cfg.model, tp, 0)[0]) if kind == "qkv" else shape[0] // tp
            return (rows, *shape[1:])
        return shape
    if kind == "qkv":
        return (len(qkv_rows(cfg.model, tp, 0)[0]), *shape[1:])
    if kind in ("column", "vocab"):
        return (shape[0] // tp, *shape[1:])
    if kind == "row" and leaf == "weight":
        return shape[0], shape[1] // tp
    return shape


def _nf4_nbytes(numel: int, block: int = 64, scale_block: int = 256, *, dp: int = 1) -> int:
    """QLoRA's storage of a weight of `numel` values on dp rank 0: packed codes, int8 block scales and fp32 group
    factors (each 1-D, split by FSDP2 into chunks of ceil(len/dp) at ZeRO-3), and the 4-byte mean every rank holds."""
    blocks = -(-numel // block)
    return sum(-(-n // dp) * size for n, size in ((blocks * block // 2, 1), (blocks, 1), (-(-blocks // scale_block), 4))) + 4


def _stage_params(cfg: Config, pp: int, pp_rank: int) -> list[tuple[str, tuple[int, ...], bool]]:
    """(name, shape, requires_grad) of the parameters a rank of this pipeline stage holds: the whole model's
    (`_model_params`) kept as `cut_to_stage` keeps them (its blocks; the embedding on the first stage, and on the
    last with tied embeddings; the final norm and head on the last). A test checks it against the cut model."""
    params = _model_params(cfg)
    if pp == 1:
        return params
    first, last = pp_rank == 0, pp_rank == pp - 1
    blocks = _stage_layers(cfg, pp, pp_rank)

    def kept(name: str) -> bool:
        top, _, rest = name.partition(".")
        if top == "blocks":
            return int(rest.partition(".")[0]) in blocks
        if top == "wte":
            return first or (last and cfg.model.tie_embeddings)
        if top == "wpe":
            return first
        if top in ("ln_f", "lm_head"):
            return last
        raise AssertionError(f"memory: no rule for parameter {name} under a pipeline")

    return [x for x in params if kept(x[0])]


def _stage_model(cfg: Config, pp: int, pp_rank: int) -> torch.nn.Module:
    """The whole GPT on the meta device, PEFT applied, cut to this pipeline stage."""
    from dist_llm.model import GPT
    from dist_llm.parallel.pipeline.stage import cut_to_stage
    from dist_llm.peft import apply_peft

    peft = cfg.peft if cfg.peft.method != "qlora" else dataclasses.replace(cfg.peft, method="lora")
    with torch.device("meta"):
        model = GPT(cfg.model)
        apply_peft(model, peft, seed=0)
    if pp > 1:
        cut_to_stage(model, cfg, pp, pp_rank)
    return model


def model_state_bytes(cfg: Config, *, dp: int, tp: int, pp: int, pp_rank: int = 0) -> Estimate:
    """Bytes of model states on rank 0 of the given pipeline stage (dp rank 0, tp rank 0). With expert
    parallelism (memory_moe) the rank holds E/ep experts, sharded by ZeRO over the dp/ep ranks that share them;
    the dense parameters over all dp ranks."""
    from dist_llm.parallel.data.zero import accum_dtype, rank_segments
    from dist_llm.precision import DTYPES

    p, t = cfg.parallel, cfg.train
    params = _stage_params(cfg, pp, pp_rank)
    ep = memory_moe.ep_degree(cfg)
    qlora = cfg.peft.method == "qlora"
    trainable: list[tuple[str, tuple[int, ...]]] = []
    frozen_bytes = 0
    for name, full_shape, requires_grad in params:
        shape = _local_shape(name, full_shape, cfg, tp)
        if ep > 1 and memory_moe.is_expert(name):
            shape = memory_moe.local_expert_shape(shape, ep)
        n = math.prod(shape)
        if requires_grad:
            trainable.append((name, shape))
        elif qlora and name.startswith("blocks.") and name.endswith(".weight") and len(full_shape) == 2:
            frozen_bytes += _nf4_nbytes(n)
        else:
            frozen_bytes += 4 * n
    mixed = t.precision != "fp32"
    est = Estimate()
    stage = p.zero_stage if dp > 1 or p.zero_stage == 3 else 0
    if p.backend == "deepspeed":
        if stage in (1, 2):
            return _deepspeed_zero_states(trainable, frozen_bytes, dp=dp, stage=stage, precision=t.precision)
        est.notes.append(f"parallel.backend=deepspeed at ZeRO-{stage}: our own form's counts, not DeepSpeed's "
                         "exact buffers")
    if stage in (1, 2) and p.backend == "native":
        compute = DTYPES[t.precision]
        size = torch.tensor([], dtype=compute).element_size()
        accum = torch.tensor([], dtype=accum_dtype(cfg)).element_size()
        est.params_bytes = frozen_bytes
        has_wte = any(n == "wte.weight" for n, _, _ in params)
        for group, group_dp in _zero_groups(trainable, dp, ep):  # (one plan each: dense over dp, experts dp/ep)
            buckets = zero_buckets(cfg, group, dp=group_dp, pp=pp, has_wte=has_wte)
            total = sum(b.numel for b in buckets)
            shard = total // group_dp
            segments = rank_segments(buckets, 0)
            est.params_bytes += total * size
            est.grads_bytes += (total if stage == 1 else shard) * accum
            est.master_bytes += 4 * shard if mixed else 0
            est.optimizer_bytes += 8 * sum(s.hi - s.lo for s in segments) + 4 * len(segments)
            est.temporary_bytes = max(est.temporary_bytes, _zero_in_flight_bytes(cfg, stage, buckets, size, accum))
        return est
    if stage == 3:  # FSDP2: dim 0 of every parameter split into dp chunks (experts: dp/ep), rank 0 the first
        def chunk(name: str, s: tuple[int, ...]) -> int:
            parts = dp // ep if memory_moe.is_expert(name) else dp
            return math.prod((-(-s[0] // parts), *s[1:])) if s else 1

        local = [chunk(n, s) for n, s in trainable]
        frozen = 0
        for name, full_shape, requires_grad in params:
            if not requires_grad:
                s = _local_shape(name, full_shape, cfg, tp)
                if qlora and name.startswith("blocks.") and name.endswith(".weight") and len(full_shape) == 2:
                    frozen += _nf4_nbytes(math.prod(s), dp=dp)  # (its NF4 storage is sharded too)
                else:
                    frozen += 4 * chunk(name, s)
        est.params_bytes = 4 * sum(local) + frozen
        est.grads_bytes = 4 * sum(local)
        est.optimizer_bytes = 8 * sum(local) + 4 * len(local)
        return est
    n_train = sum(math.prod(s) for _, s in trainable)
    est.params_bytes = 4 * n_train + frozen_bytes
    est.grads_bytes = 4 * n_train
    est.optimizer_bytes = 8 * n_train + 4 * len(trainable)
    return est


def _zero_groups(trainable: list[tuple[str, tuple[int, ...]]], dp: int,
                 ep: int) -> list[tuple[list[tuple[str, tuple[int, ...]]], int]]:
    """The (parameters, ranks sharing them) ZeRO-1/2 plans: one over dp, or at ep>1 the dense parameters over dp
    and the rank's experts over the dp/ep ranks of its expert-data-parallel group."""
    if ep == 1:
        return [(trainable, dp)]
    dense = [x for x in trainable if not memory_moe.is_expert(x[0])]
    experts = [x for x in trainable if memory_moe.is_expert(x[0])]
    return [(dense, dp), (experts, dp // ep)]


def zero_buckets(cfg: Config, trainable: list[tuple[str, tuple[int, ...]]], *, dp: int, pp: int,
                 has_wte: bool) -> list[Any]:
    """Our ZeRO-1/2's buckets (zero.plan_buckets) for these trainable (name, local shape)s, in registration order."""
    from types import SimpleNamespace

    from dist_llm.parallel.data.zero import bucket_numel, plan_buckets, tied_alone
    from dist_llm.precision import DTYPES

    fake = [(n, torch.empty(s, device="meta")) for n, s in trainable][::-1]
    alone = tied_alone(cfg, pp, SimpleNamespace(wte=True if has_wte else None))  # type: ignore[arg-type]
    return plan_buckets(fake, dp, bucket_numel(cfg.parallel.bucket_mb, DTYPES[cfg.train.precision]),
                        frozenset([alone] if alone else []))


def _deepspeed_zero_states(trainable: list[tuple[str, tuple[int, ...]]], frozen_bytes: int, *, dp: int, stage: int,
                           precision: str) -> Estimate:
    """DeepSpeed's ZeRO-1/2 (`DeepSpeedZeroOptimizer`), counted as its estimator
    `estimate_zero2_model_states_mem_needs` (no offload) counts them: the module's parameters in the compute
    dtype, whole; the reduced gradient partition in that dtype plus the fp32 copy of it that its step makes;
    the fp32 master partition and Adam's two moments; all but the parameters 1/dp. bf16: 2 + 18/dp bytes per
    parameter. Stage 1 holds the same at the step (it too keeps only its partition's gradients between
    micro-steps); both hold each parameter's whole gradient for a moment in backward, until its bucket is
    reduced. Its flat buffers pad each parameter group by fewer than dp elements, left out; Adam's `step` is
    one 4-byte tensor per group."""
    n = sum(math.prod(s) for _, s in trainable)
    size = 4 if precision == "fp32" else 2
    groups = len({len(s) >= 2 for _, s in trainable})  # decay (matrices) and no-decay (vectors), flattened
    return Estimate(params_bytes=size * n + frozen_bytes, grads_bytes=round((size + 4) * n / dp),
                    master_bytes=round(4 * n / dp), optimizer_bytes=round(8 * n / dp) + 4 * groups)


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


def _zero_in_flight_bytes(cfg: Config, stage: int, buckets: list[Any], size: int, accum: int) -> int:
    """ZeRO-1/2's transient gradient bytes during backward, beyond the model states. Stage 2: its two bucket
    buffers (compute dtype; bucket i in buffer i % 2, so at most two buckets in flight) and the gradients
    autograd holds for the bucket that is filling (at most the largest) before they move into a buffer.
    Stage 1 with a wider accumulator: one parameter's 16-bit gradient at a time (within a bucket). On gloo
    (CPU) each reduce-scatter in flight also has an all-to-all scratch of its bucket (comm.py; NCCL reduces
    in place): both buffers' worth for stage 2, one bucket (in the accumulator's dtype) for stage 1."""
    from dist_llm.parallel.data.zero import buffer_numels

    largest = max(b.numel for b in buckets)
    gloo = _runs_on_gloo(cfg)
    if stage == 2:
        buffers = sum(buffer_numels(buckets)) * size
        return buffers * (2 if gloo else 1) + largest * size
    return largest * (size if accum != size else 0) + (largest * accum if gloo else 0)


def ring_buffer_bytes(cfg: Config, *, tp: int, cp: int) -> int:
    """Ring attention's transient buffers at cp > 1, in one layer's backward (the larger pass): the key/value block
    held and the one arriving (compute dtype), their fp32 gradient accumulators in flight both ways and this rank's
    own, fp32 dq and dO, and one tile's fp32 scores, probabilities and their gradient, (B, nh, rows, T/cp) each (a
    block is computed ring.QUERY_ROWS queries at a time)."""
    from dist_llm.parallel.context_parallel.ring import QUERY_ROWS

    if cp == 1:
        return 0
    m, t = cfg.model, cfg.train
    size = 4 if t.precision == "fp32" else 2
    t_local = m.block_size // cp
    heads, kv_heads = m.n_head // tp, max(1, m.kv_heads // tp)
    kv_block = 2 * t.micro_batch_size * kv_heads * t_local * m.head_dim  # k and v
    q_block = t.micro_batch_size * heads * t_local * m.head_dim
    scores = t.micro_batch_size * heads * min(QUERY_ROWS, t_local) * t_local
    return 2 * kv_block * size + 3 * kv_block * 4 + 2 * q_block * 4 + 3 * scores * 4


def temporary_bytes(cfg: Config, *, dp: int, tp: int, cp: int = 1) -> int:
    """The largest transient buffer: the fp32 logits and their softmax for the loss, or an FSDP2 unit gathered
    (a block's parameters, twice with prefetch; the embedding or the head, twice on a GPU: the all-gather's buffer
    and FSDP2's copy of it into the parameter live together for a moment; once on the CPU, gathered in place). (ZeRO-1/2's in-flight gradients come
    with the model states' plan of buckets: `_zero_in_flight_bytes`.)"""
    m, t, p = cfg.model, cfg.train, cfg.parallel
    logits = 2 * t.micro_batch_size * m.block_size // cp * m.padded_vocab // tp * 4
    candidates = [logits, ring_buffer_bytes(cfg, tp=tp, cp=cp)]
    if dp * cp > 1 and p.zero_stage == 3:  # a unit gathered (over dp x cp): its all-gather buffer and FSDP2's copy
        size = 4 if t.precision == "fp32" else 2
        candidates.append(2 * _block_params(cfg) // tp * size)
        # the embedding or the head (a unit each, parallel/data/fsdp.py): vocabulary x width, often the largest;
        # on the CPU gathered straight into the parameter (fsdp.GatherIntoParameter), on a GPU beside its buffer
        copies = 1 if _runs_on_gloo(cfg) else 2
        candidates.append(copies * m.padded_vocab * m.n_embd // tp * size)
    sp = p.sequence_parallel and tp > 1
    if t.activation_checkpointing == "full":  # one block's activations, recomputed during its backward
        layer = _layer_bytes(cfg, tp=tp, dp=dp, sequence_parallel=sp)
        if m.n_experts:
            layer = max(layer, _moe_layer_bytes(cfg, tp=tp, dp=dp, sequence_parallel=sp))
        candidates.append(round(layer * t.micro_batch_size * m.block_size // cp))
    if m.n_experts:  # expert parallelism's dispatch all-to-all: send and receive buffers (balanced load)
        tokens = t.micro_batch_size * m.block_size // tp  # (a tp rank routes 1/tp of them)
        candidates.append(memory_moe.a2a_buffer_bytes(cfg, tokens, memory_moe.ep_degree(cfg)))
    return max(candidates)


_DTYPE_BYTES = {"float32": 4, "float": 4, "float16": 2, "half": 2, "bfloat16": 2, "float64": 8}


def largest_tensor_numel(cfg: Config) -> int:
    """Elements of the model's largest single parameter, whole (often the embedding: padded_vocab x n_embd; the
    MLP's matrices where n_embd x ffn_hidden is larger). PEFT's adapters are small and left out."""
    return max(math.prod(shape) for _, shape, _ in _model_params(cfg, peft=False))


def _source_bytes(cfg: Config) -> int:
    """Bytes per element of the weights `model.init_from` reads: an `hf:` directory's config.json dtype
    (`torch_dtype`, or `dtype` in newer transformers), else fp32 (our checkpoints)."""
    spec = cfg.model.init_from
    if not spec.startswith("hf:"):
        return 4
    from dist_llm.hf import read_hf_config

    try:
        config = read_hf_config(spec.partition(":")[2])
    except ConfigError:  # not there yet (planning a run): assume fp32, the larger
        return 4
    name = config.get("torch_dtype") or config.get("dtype") or "float32"
    return _DTYPE_BYTES.get(str(name).removeprefix("torch."), 4)


def init_draw_numel(cfg: Config) -> int:
    """Elements of the largest piece model/init.py draws at once while building (at most: a piece drawn straight
    into the rank's own fp32 rows allocates nothing): one expert of a stacked expert tensor, CHUNK_NUMEL elements'
    worth of whole rows of any other; the fused QKV whole under tp (its rows, the rank's q, k and v heads, are
    not one slice)."""
    from dist_llm.model.init import CHUNK_NUMEL

    largest = 0
    for name, shape, _ in _model_params(cfg, peft=False):
        row = math.prod(shape[1:])
        if memory_moe.is_expert(name):
            piece = row
        elif cfg.parallel.tp > 1 and name.endswith(".attn.qkv.weight"):
            piece = math.prod(shape)
        else:
            piece = min(math.prod(shape), max(1, CHUNK_NUMEL // max(1, row)) * row)
        largest = max(largest, piece)
    return largest


#: NF4Weight.quantize's working bytes per element beyond the weight: the padded copy and the normalised values
#: (fp32 each) and the level indices (uint8); plus, per element searched at once, the distances to the 16 levels
#: and their absolute values (fp32 each)
_NF4_BYTES_PER_ELEMENT = 4 + 4 + 1
_NF4_SEARCH_BYTES = 2 * 16 * 4


def _block_linear(name: str) -> bool:
    from dist_llm.peft.qlora import BLOCK_LINEARS

    return name.startswith("blocks.") and name.endswith(tuple(f".{path}.weight" for path in BLOCK_LINEARS))


def init_transient_bytes(cfg: Config) -> int:
    """The build's transient beyond this rank's parameters, by the largest of what the build allocates whole:
      - in fp32, the largest piece model/init.py draws (`init_draw_numel`);
      - DeepSpeed's ZeRO-3 (`deepspeed_shards.build_partitioned`): each parameter of this rank's tp/ep part
        allocated whole in fp32, then its 16-bit copy for the engine (bf16/fp16) before the partitioner keeps a
        range: the largest parameter at 4 + 2 bytes an element (4 in fp32);
      - QLoRA (`qlora.materialise_quantised`, `qlora.quantise`, `_build_nf4`): each block linear allocated whole
        in fp32 and quantised to NF4 (`NF4Weight.quantize`'s working space: `_NF4_BYTES_PER_ELEMENT`, and the
        level search over at most nf4._SEARCH_CHUNK elements at once)."""
    from dist_llm.parallel.data.deepspeed_shards import builds_partitioned
    from dist_llm.peft.nf4 import _SEARCH_CHUNK

    candidates = [4 * init_draw_numel(cfg)]
    tp, ep = cfg.parallel.tp, memory_moe.ep_degree(cfg)
    qlora = cfg.peft.method == "qlora"
    for name, shape, _ in _model_params(cfg, peft=False):
        n = math.prod(_rank_shape(name, shape, cfg, tp, ep))
        if qlora and _block_linear(name):
            candidates.append((4 + _NF4_BYTES_PER_ELEMENT) * n + _NF4_SEARCH_BYTES * min(n, _SEARCH_CHUNK))
        elif builds_partitioned(cfg):
            candidates.append(n * (4 if cfg.train.precision == "fp32" else 4 + 2))
    return max(candidates)


def transient_bytes(cfg: Config) -> tuple[int, int, int]:
    """(init, load, export) transients: what building the model allocates beyond a rank's shards
    (`init_transient_bytes`), and what holding the largest full tensor costs while loading weights and exporting
    a checkpoint. The bound a shard-by-shard implementation keeps to (issue 17); beyond a rank's own shards,
    which the model states count."""
    largest = largest_tensor_numel(cfg)
    return init_transient_bytes(cfg), largest * (_source_bytes(cfg) + 4), 8 * largest


def _rank_shape(name: str, shape: tuple[int, ...], cfg: Config, tp: int, ep: int) -> tuple[int, ...]:
    """The shape of `name` this rank holds before ZeRO: its tp piece, and of a stacked expert tensor E/ep
    experts."""
    local = _local_shape(name, shape, cfg, tp)
    return memory_moe.local_expert_shape(local, ep) if ep > 1 and memory_moe.is_expert(name) else local


def pipelined_zero3_bytes(cfg: Config, *, tp: int, pp: int, pp_rank: int) -> int:
    """What ZeRO-3 (FSDP2) under a pipeline holds whole through a step (parallel/data/fsdp.py): the stage's
    gradients accumulated unsharded in fp32 over its micro-batches (reduce-scattered once, in its last backward),
    and unless parallel.reshard_after_forward=true its parameters, gathered in the compute dtype at its first
    forward and kept to its last backward. (A quantised base is counted at 4 bytes an element: an overestimate.)"""
    p, t = cfg.parallel, cfg.train
    if pp == 1 or p.zero_stage != 3 or p.backend != "native":
        return 0
    ep = memory_moe.ep_degree(cfg)
    local = [(math.prod(_rank_shape(n, s, cfg, tp, ep)), g) for n, s, g in _stage_params(cfg, pp, pp_rank)]
    grads = 4 * sum(n for n, g in local if g)
    size = 4 if t.precision == "fp32" else 2
    return grads + (0 if reshard_after_forward(cfg) else size * sum(n for n, _ in local))


def predict(cfg: Config, world_size: int | None = None, *, pp_rank: int | None = None) -> Estimate:
    """Per-rank bytes for `cfg` at `world_size` ranks (default: dp*tp*pp with dp=1 when parallel.dp is 0).
    With a pipeline, the stage that needs the most (or `pp_rank`)."""
    from dist_llm.parallel.context import resolve_degrees

    p = cfg.parallel
    world = world_size or max(1, p.dp) * p.cp * p.tp * p.pp
    dp, tp, pp = resolve_degrees(world, p.dp, p.tp, p.pp, global_batch_size=cfg.train.global_batch_size,
                                 micro_batch_size=cfg.train.micro_batch_size, cp=p.cp)
    ep = memory_moe.check_ep(cfg, dp)
    stages = [pp_rank] if pp_rank is not None else range(pp)
    best: Estimate | None = None
    for s in stages:
        # (ZeRO shards over dp x cp: context-parallel ranks hold the same parameters, parallel/context.py)
        est = model_state_bytes(cfg, dp=dp * p.cp, tp=tp, pp=pp, pp_rank=s)
        est.activation_bytes = activation_bytes(cfg, tp=tp, pp=pp, pp_rank=s, dp=dp, cp=p.cp)
        est.temporary_bytes = max(est.temporary_bytes, temporary_bytes(cfg, dp=dp, tp=tp, cp=p.cp))
        held = pipelined_zero3_bytes(cfg, tp=tp, pp=pp, pp_rank=s)
        if held:  # held through the step, beside the activations and the largest transient
            est.temporary_bytes += held
            est.notes.append(f"ZeRO-3 with pp: {held / 2**20:.2f} MiB held through a step on stage {s} (its gradients "
                             "accumulated whole in fp32, reduce-scattered once a step"
                             + ("" if reshard_after_forward(cfg) else ", and its parameters gathered in the compute "
                                "dtype from its first forward to its last backward; parallel.reshard_after_forward="
                                "true regathers them per micro-batch instead") + ")")
        _pending_weights(est, cfg, dp=dp, tp=tp, pp=pp, pp_rank=s)
        if cfg.model.n_experts:
            _moe_figures(est, cfg, dp=dp, tp=tp, pp=pp, pp_rank=s, ep=ep)
        if p.offload == "cpu":
            est.offloaded = True
            est.notes.append("parallel.offload=cpu: parameters, gradients and optimizer states live in host memory "
                             "(host_bytes); the device holds one gathered unit at a time")
        if best is None or est.peak_bytes > best.peak_bytes:
            best = est
    assert best is not None
    best.init_transient_bytes, best.load_transient_bytes, best.export_transient_bytes = transient_bytes(cfg)
    return best


def _pending_weights(est: Estimate, cfg: Config, *, dp: int, tp: int, pp: int, pp_rank: int) -> None:
    pending = memory_pipeline.pending_weight_bytes(cfg, tp=tp, pp=pp, pp_rank=pp_rank, dp=dp,
                                                   blocks=len(_blocks(cfg, pp, pp_rank)), params16=_params16(cfg, dp))
    if pending is None:
        est.notes.append(f"ZB-H1: the gradients held from each B to its W on stage {pp_rank} are not counted for MoE "
                         "or PEFT models (an underestimate)")
    elif pending:
        est.pending_weight_bytes = pending
        est.notes.append(f"ZB-H1: {pending / 2**20:.2f} MiB on stage {pp_rank} of gradients its held-back W's keep "
                         "from their B (each weight op's output gradient, for up to stage + 1 micro-batches)")


def _moe_figures(est: Estimate, cfg: Config, *, dp: int, tp: int, pp: int, pp_rank: int, ep: int) -> None:
    """The routed-token figures `dist-llm memory` prints for an MoE model; the peak keeps the balanced load."""
    m, t = cfg.model, cfg.train
    tokens = t.micro_batch_size * m.block_size // tp  # routed on this rank (its 1/tp under tensor parallelism)
    n_moe = sum(1 for i in _blocks(cfg, pp, pp_rank) if m.is_moe_block(i))
    in_flight = _in_flight(cfg, pp=pp, pp_rank=pp_rank, dp=dp)
    rows = memory_moe.routed_rows(cfg, tokens, ep)
    per_row = memory_moe.received_row_bytes(cfg, ep) * n_moe * in_flight
    worst = activation_bytes(cfg, tp=tp, pp=pp, pp_rank=pp_rank, dp=dp, worst=True)
    a2a_worst = memory_moe.a2a_buffer_bytes(cfg, tokens, ep, worst=True)
    est.moe = {"ep": ep, "routed_rows": rows.assignments, "received_rows_balanced": rows.received_balanced,
               "received_rows_worst": rows.received_worst,
               "routed_activation_bytes_balanced": per_row * rows.received_balanced,
               "routed_activation_bytes_worst": per_row * rows.received_worst,
               "a2a_buffer_bytes_balanced": memory_moe.a2a_buffer_bytes(cfg, tokens, ep),
               "a2a_buffer_bytes_worst": a2a_worst, "activation_bytes_worst": worst,
               "peak_bytes_worst": est.peak_bytes - est.activation_bytes + worst
               + max(0, a2a_worst - est.temporary_bytes)}
    est.moe_lines = memory_moe.summary_lines(cfg, tokens, ep, n_moe, in_flight)


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
        lines.append("transients: the largest whole tensor while building, loading weights and exporting (besides "
                     "the model states; not in the training peak)")
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
