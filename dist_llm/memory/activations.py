"""What a rank saves for backward: activation bytes per layer, stage and micro-batches in flight.

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

import functools
import math
import re
from typing import Iterable

import torch

from dist_llm.config import Config
from dist_llm.memory import moe as memory_moe
from dist_llm.memory.estimate import _runs_on_gloo
from dist_llm.memory.params import _params16, _stage_layers


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


def attention_widths(cfg: Config, tp: int) -> tuple[float, float]:
    """Values per token of this tp rank's q and of its k (or v): its 1/tp of the heads, or one whole kv head where
    the kv heads are fewer than tp (each rank then keeps a copy of its group's)."""
    m = cfg.model
    return m.n_head * m.head_dim / tp, (m.kv_heads * m.head_dim / tp if m.kv_heads >= tp else m.head_dim)


def our_layer_values(cfg: Config, tp: int, *, sequence_parallel: bool) -> tuple[float, float]:
    """Values a block of our GPT saves for backward per token: (16-bit-able values, fp32 values). The first
    are matmul outputs that autocast computes in the compute dtype; the second stay fp32 in mixed precision
    (the residual stream, norm statistics, the attention log-sum-exp). A linear keeps its input only when
    its weight is trained or carries LoRA; a frozen base (PEFT) keeps less."""
    m, f = cfg.model, cfg.peft
    c = m.n_embd
    q, kv = attention_widths(cfg, tp)
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
    if f.method == "adapter":  # after attention and MLP: its input, the bottleneck, and its activation (under SP
        low += 2 * (c + 2 * f.rank) / seq  # on the rank's slice of the tokens)
    high = 2 * norm_in + 2 * norm_stats + m.n_head / tp  # log-sum-exp per head
    return low, high


def rms_norm_composite(cfg: Config) -> bool:
    """Whether each RMSNorm runs aten's composite rather than a fused kernel.

    nn.RMSNorm calls aten's rms_norm, which runs `_fused_rms_norm`: on CUDA (and XPU) a fused kernel whose backward
    takes the input, rstd and weight (derivatives.yaml), nothing else, the input in its own dtype; elsewhere (the
    CPU) its composite, which upcasts the input to fp32 first and then runs pow -> mean -> rsqrt -> mul(x, rstd) ->
    mul(., weight) on the upcast copy: what it saves is fp32 whatever the parameters' dtype (with 16-bit parameters,
    our ZeRO-1/2's, the saved input is 4 bytes a value, not 2: measured with scripts/saved_tensors_by_op.py, 18
    fp32 (B, T, C) tensors for the 9 norms of configs/tiny.yaml in bf16). Which device: train.device, or with
    "auto" whether CUDA is present here, as the trainer picks it. Torch without `_fused_rms_norm_backward` (before
    its CUDA kernel) runs the composite everywhere."""
    return cfg.model.norm == "rmsnorm" and (_runs_on_gloo(cfg) or not hasattr(torch.ops.aten, "_fused_rms_norm_backward"))


def rms_norm_saves_normalised(cfg: Config) -> bool:
    """Whether each RMSNorm keeps its normalised output x * rstd for backward, besides its input and rstd: the
    composite's last product keeps it for the weight's gradient (`rms_norm_composite`), so only where that weight
    trains: PEFT freezes the norms (autograd then saves no input of a product for a factor that needs no gradient).
    On an H200 (torch 2.11) configs/tiny.yaml fp32 saved 18.00 MiB less than on the CPU, and moe.yaml bf16 18.00 MiB
    less: one (B, T, C) fp32 tensor for each of the 9 norms (4 blocks x 2 and the final one); the SDPA kernels
    (efficient, cuDNN, flash-cpu) save the same q, k, v, output and log-sum-exp there."""
    return cfg.peft.method == "none" and rms_norm_composite(cfg)


def _norm_input_bytes(cfg: Config, dp: int) -> int:
    """Bytes of a value a norm saves of its input (and RMSNorm's composite of its normalised output): the
    residual stream's dtype, 16-bit only with 16-bit parameters, except under RMSNorm's composite (fp32 copies)
    and LayerNorm on CUDA, which autocast runs in fp32 (its list in aten's autocast_mode.cpp: the 16-bit input
    is cast up, and the norm keeps that fp32 copy; on the CPU autocast leaves layer_norm in its input's dtype)."""
    if cfg.train.precision == "fp32" or not _stream16(cfg, dp) or rms_norm_composite(cfg):
        return 4
    if cfg.model.norm == "layernorm" and not _runs_on_gloo(cfg):
        return 4
    return 2


def _norm_stat_bytes(cfg: Config, dp: int) -> int:
    """Bytes of a norm statistic (LayerNorm's mean and rstd, RMSNorm's rstd): fp32, except LayerNorm's CPU kernel
    over a 16-bit input (16-bit parameters), which returns them in the input's dtype (CUDA's kernel in fp32, and
    autocast runs it on fp32 copies there: `_norm_input_bytes`)."""
    if cfg.model.norm == "layernorm" and cfg.train.precision != "fp32" and _stream16(cfg, dp) and _runs_on_gloo(cfg):
        return 2
    return 4


def _mlp_low_values(cfg: Config, tp: int, seq: int = 1) -> float:
    """The dense MLP's part of `our_layer_values`' 16-bit values (an MoE block has moe.py's instead): its
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


def _stream16(cfg: Config, dp: int) -> bool:
    """Whether the model the matmuls read is 16-bit (its weights and so the residual stream): `_params16`, except
    our ZeRO-1/2 under PEFT, which makes only the trained parameters (LoRA, adapters) 16-bit; the frozen model
    stays fp32 (parallel/data/zero.py takes the parameters that need a gradient)."""
    return _params16(cfg, dp) and not (cfg.parallel.backend == "native" and cfg.peft.method != "none")


def casts_fp32_weights(cfg: Config, *, dp: int, world: int) -> bool:
    """Whether the matmuls read fp32 parameters (and the fp32 residual stream) through autocast's casts: mixed
    precision over fp32 parameters. Not with 16-bit parameters (our ZeRO-1/2 over dp x cp > 1, DeepSpeed) nor
    under FSDP2 (native ZeRO-3 on more than one rank, parallel/data.uses_fsdp: it gathers them in the compute
    dtype). `dp` is dp x cp (what ZeRO shards over); `world` every rank."""
    p = cfg.parallel
    if cfg.train.precision == "fp32" or _stream16(cfg, dp):
        return False
    return not (p.zero_stage == 3 and p.backend == "native" and world > 1)


def _norm_output_fp32(cfg: Config, *, dp: int, world: int) -> bool:
    """Whether in mixed precision a norm's output, the input the matmuls after it cast, is fp32: over fp32
    parameters (`casts_fp32_weights`), and for LayerNorm on CUDA whatever the parameters (autocast runs it in
    fp32 there: `_norm_input_bytes`)."""
    if cfg.train.precision == "fp32":
        return False
    return casts_fp32_weights(cfg, dp=dp, world=world) or (cfg.model.norm == "layernorm" and not _runs_on_gloo(cfg))


def _norm_weight_copy_bytes(cfg: Config, *, dp: int, world: int, norms: int) -> int:
    """Bytes a micro-batch keeps of autocast's fp32 copies of `norms` LayerNorms' 16-bit weight and bias on CUDA
    (autocast casts them up with the input; the backward keeps both); none on the CPU, over fp32 parameters, or
    with RMSNorm."""
    m = cfg.model
    if (m.norm != "layernorm" or _runs_on_gloo(cfg) or cfg.train.precision == "fp32"
            or casts_fp32_weights(cfg, dp=dp, world=world)):
        return 0
    return norms * (2 if m.bias else 1) * m.n_embd * 4


def _gated_copy_bytes(cfg: Config, *, tp: int, dp: int, world: int, sequence_parallel: bool) -> float:
    """Bytes per token of a second 16-bit copy of a gated MLP's input (the values count one, `_mlp_low_values`).
    Gate and up read one autocast copy of an fp32 input (model/casting.py: the plain layers and the column-
    parallel ones), and the sequence-parallel layers cast it once before their gather (parallel/tensor/layers.py);
    under LoRA, whose A's join their base layers through hooks, each A casts its input itself (the whole input, or
    under SP its local slice) and keeps its own copy. 16-bit inputs need no cast (`_norm_output_fp32`). With LoRA
    dropout each A keeps its own dropped copy instead (`_lora_dropout_bytes`)."""
    m, f = cfg.model, cfg.peft
    if (m.mlp != "swiglu" or f.method not in ("lora", "qlora") or "mlp_up" not in f.targets or f.dropout > 0
            or not _norm_output_fp32(cfg, dp=dp, world=world)):
        return 0.0
    return 2 * m.n_embd / tp if sequence_parallel and tp > 1 else 2 * m.n_embd


def _shared_copy_bytes(cfg: Config, *, dp: int, world: int) -> float:
    """Bytes per token of the 16-bit copies of an MoE block's shared-expert input beyond the one moe.py counts:
    a SwiGLU shared expert's second (the dense MLP's case, `_gated_copy_bytes`, with plain layers at every tp)
    and model.moe_shared_gate's own (its matmul casts the fp32 input again and keeps that copy for its weight's
    gradient; a frozen gate, under PEFT, keeps none)."""
    m = cfg.model
    if not m.n_shared_experts:
        return 0.0
    gate = m.moe_shared_gate and cfg.peft.method == "none" and _norm_output_fp32(cfg, dp=dp, world=world)
    return _gated_copy_bytes(cfg, tp=1, dp=dp, world=world, sequence_parallel=False) + (2 * m.n_embd if gate else 0)


def _layer_bytes(cfg: Config, *, tp: int, dp: int, sequence_parallel: bool, world: int = 0) -> float:
    """Bytes per token one block saves. In mixed precision matmul outputs are 16-bit; the residual stream
    stays fp32 unless the parameters themselves are 16-bit (our ZeRO-1/2 keep them so, with fp32 masters).
    `world` (default dp x tp) tells FSDP2 from the plain form at ZeRO-3."""
    low, high = our_layer_values(cfg, tp, sequence_parallel=sequence_parallel)
    dropout = _lora_dropout_bytes(cfg, cfg.peft.targets, tp=tp, dp=dp, seq=tp if sequence_parallel else 1)
    dropout += _gated_copy_bytes(cfg, tp=tp, dp=dp, world=world or dp * tp, sequence_parallel=sequence_parallel)
    if cfg.train.precision == "fp32":
        return 4 * (low + high) + dropout
    lse = cfg.model.n_head / tp
    stats = 2 * (1 if cfg.model.norm == "rmsnorm" else 2) / (tp if sequence_parallel else 1)
    # (high - lse - stats: the norms' inputs, and RMSNorm's normalised outputs where it keeps them)
    return (2 * low + _norm_input_bytes(cfg, dp) * (high - lse - stats) + 4 * lse + _norm_stat_bytes(cfg, dp) * stats
            + dropout)


def _moe_layer_bytes(cfg: Config, *, tp: int, dp: int, sequence_parallel: bool, worst: bool = False,
                     world: int = 0) -> float:
    """Bytes per token an MoE block saves: the dense block's without its MLP, plus router, routed and shared
    experts (moe.py) for one micro-batch, at the balanced or the worst-case load."""
    tokens = cfg.train.micro_batch_size * cfg.model.block_size
    world = world or dp * tp
    dense = _layer_bytes(cfg, tp=tp, dp=dp, sequence_parallel=sequence_parallel, world=world)
    mlp = (4 if cfg.train.precision == "fp32" else 2) * _mlp_low_values(cfg, tp) + _lora_dropout_bytes(
        cfg, {"mlp_up", "mlp_down"} & set(cfg.peft.targets), tp=tp, dp=dp, seq=tp if sequence_parallel else 1)
    mlp += _gated_copy_bytes(cfg, tp=tp, dp=dp, world=world, sequence_parallel=sequence_parallel)
    # (under tp each rank routes its 1/tp of the tokens through whole experts: parallel/tensor/moe.py; the
    # experts' 16-bit copies exist wherever the dense layers' do: FSDP2 gathers them in 16 bits)
    moe = memory_moe.moe_block_bytes(cfg, tokens // tp, memory_moe.ep_degree(cfg), params16=_stream16(cfg, dp),
                                     worst=worst, casts=casts_fp32_weights(cfg, dp=dp, world=world))
    shared = _shared_copy_bytes(cfg, dp=dp, world=world) / tp  # (a tp rank's 1/tp of the tokens)
    return dense - mlp + moe / tokens + shared


def _head_bytes(cfg: Config, tp: int, dp: int, *, sequence_parallel: bool) -> float:
    """Bytes per token saved by the final norm, the LM head and the loss, and the loss's targets (int64). The
    head's matmul keeps its input in the compute dtype (autocast's 16-bit copy of the norm's output in mixed
    precision); the log-softmax over the vocabulary stays fp32."""
    m = cfg.model
    seq = tp if sequence_parallel else 1
    rms = m.norm == "rmsnorm"
    norm_in = m.n_embd / seq * (2 if rms_norm_saves_normalised(cfg) else 1)
    norm = norm_in * _norm_input_bytes(cfg, dp) + (1 if rms else 2) / seq * _norm_stat_bytes(cfg, dp)
    # a frozen head needs no input for its gradient; under SP the head keeps its input's local slice
    head_input = m.n_embd / seq * (4 if cfg.train.precision == "fp32" else 2) if cfg.peft.method == "none" else 0
    return norm + head_input + _loss_bytes(cfg, tp)


def _loss_bytes(cfg: Config, tp: int) -> float:
    """Bytes per token the loss keeps: the softmax over the rank's vocabulary (fp32) and the targets (int64); at
    tp > 1 the vocabulary-parallel loss also two bool masks (the targets in this rank's slice, those not ignored)."""
    return 4 * cfg.model.padded_vocab / tp + 8 + (2 if tp > 1 else 0)


def _ids_bytes(cfg: Config, tp: int) -> float:
    """Bytes per token the embeddings keep on the first stage where they train: the token ids (int64; at tp > 1
    the vocabulary-parallel embedding's local ids and its bool mask of ids outside its slice) and, with learned
    positions, the positions (int64, one per position of the micro-batch's sequences, whatever their number)."""
    if cfg.peft.method != "none":
        return 0.0
    positions = 8 / cfg.train.micro_batch_size if cfg.model.pos_emb == "learned" else 0.0
    return 8 + (1 if tp > 1 else 0) + positions


_COPIES: dict[str, tuple[float, float]] = {}


def autocast_weight_copy_bytes(cfg: Config, *, tp: int, pp: int, pp_rank: int, dp: int, world: int = 0,
                               head_only: bool = False) -> int:
    """Bytes of autocast's 16-bit copies of fp32 weights that one micro-batch keeps for backward on this stage.

    In mixed precision over fp32 parameters (`casts_fp32_weights`) each matmul's weight is cast to the compute
    dtype, and autograd keeps that copy for the input's gradient until the micro-batch's backward; each
    micro-batch's forward runs in an autocast region of its own, whose cast cache ends with it, so every
    micro-batch in flight holds its own: 2 bytes a weight element of the stage's linear layers (attention, the
    dense MLP or an MoE block's shared experts, LoRA's A and B, adapters; this tp rank's slice) and of the LM head
    on the last stage. The sequence-parallel layers (qkv, gate and up, the head at tp > 1) cast by hand and keep
    the fp32 parameter instead; the routed experts' copies are moe.py's, the router runs in fp32. Under PEFT the
    layers of block 0 whose input needs no gradient keep none (before the first LoRA, and its base and A; with
    adapters the attention's), and QLoRA's NF4 base weights are dequantized by its own function. `dp` is dp x cp,
    `world` every rank (default dp x tp x pp); `head_only`: the head's alone (full activation checkpointing
    recomputes the blocks, not the head)."""
    world = world or dp * tp * pp
    if not casts_fp32_weights(cfg, dp=dp, world=world):
        return 0
    m, f = cfg.model, cfg.peft
    sp = cfg.parallel.sequence_parallel and tp > 1
    blocks = tuple(_blocks(cfg, pp, pp_rank))
    adapters16 = _params16(cfg, dp)  # (here: our ZeRO-1/2 under PEFT, whose LoRA / adapter weights are 16-bit)
    key = repr((m, f, tp, sp, blocks, pp_rank == 0, adapters16))
    if key not in _COPIES:
        if len(_COPIES) >= 256:  # (`memory --suggest` asks for every variant's stages)
            _COPIES.pop(next(iter(_COPIES)))
        _COPIES[key] = (_block_copy_elements(cfg, tp, sp, blocks, first_stage=pp_rank == 0, adapters16=adapters16),
                        0.0 if sp else m.padded_vocab / tp * m.n_embd)
    in_blocks, head = _COPIES[key]
    return round(2 * ((0.0 if head_only else in_blocks) + (head if pp_rank == pp - 1 else 0.0)))


def _block_copy_elements(cfg: Config, tp: int, sp: bool, blocks: tuple[int, ...], *, first_stage: bool,
                         adapters16: bool = False) -> float:
    """Weight elements of `blocks` whose 16-bit copies a micro-batch keeps (`autocast_weight_copy_bytes`)."""
    from dist_llm.memory.params import _local_shape, _model_params

    f = cfg.peft
    unsaved: set[str] = set()
    if first_stage and f.method in ("lora", "qlora"):  # block 0 up to its first LoRA: the input needs no gradient
        order = [("qkv", "attn.qkv"), ("attn_out", "attn.proj"), ("mlp_up", "mlp.up"), ("mlp_up", "mlp.gate"),
                 ("mlp_down", "mlp.down")]
        first = next((t for t, _ in order if t in f.targets), None)
        if first is not None:
            through = max(i for i, (t, _) in enumerate(order) if t == first)
            for target, layer in order[: through + 1]:
                unsaved.add(f"blocks.0.{layer}.weight")
                if target == first:  # (its B's input, A x, needs a gradient: B keeps its copy)
                    unsaved.add(f"blocks.0.{layer}.lora.A")
    elif first_stage and f.method == "adapter":  # the attention's adapter comes after it
        # (and its down projection, whose input is theirs: only its up keeps a copy)
        unsaved = {"blocks.0.attn.qkv.weight", "blocks.0.attn.proj.weight", "blocks.0.attn.adapter.down.weight"}
    sp_layers = re.compile(r"\.(attn\.qkv|mlp\.up|mlp\.gate)\.weight$")
    wanted = {str(i) for i in blocks}
    n = 0.0
    for name, shape, _ in _model_params(cfg, peft=True):
        parts = name.split(".")
        if (parts[0] != "blocks" or parts[1] not in wanted or len(shape) != 2 or ".moe.experts." in name
                or ".moe.router." in name or name in unsaved or (sp and sp_layers.search(name))):
            continue
        if f.method == "qlora" and ".lora." not in name:
            continue
        if adapters16 and (".lora." in name or ".adapter." in name):
            continue
        n += math.prod(_local_shape(name, shape, cfg, tp))
    return n


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
        return _interleaved_peaks(pp, micro, p.pp_virtual)[pp_rank] / p.pp_virtual
    return min(micro, pp - pp_rank)


@functools.lru_cache(maxsize=256)  # (`memory --suggest` asks for every variant's stages: one schedule each)
def _interleaved_peaks(pp: int, micro: int, chunks: int) -> tuple[int, ...]:
    """Each stage's peak of chunk forwards in flight under the interleaved schedule."""
    from dist_llm.parallel.pipeline.schedule import interleaved, peak_in_flight

    return tuple(peak_in_flight(plan) for plan in interleaved(pp, micro, chunks))


def _values_bytes(cfg: Config, dp: int, low: float, norm: float = 0.0, fp32: float = 0.0) -> float:
    """Bytes of values per token as `_layer_bytes` sizes them: matmul outputs (`low`, 16-bit in mixed precision),
    norm inputs (`norm`, 16-bit only with 16-bit parameters), statistics and log-sum-exps (`fp32`)."""
    if cfg.train.precision == "fp32":
        return 4 * (low + norm + fp32)
    return 2 * low + _norm_input_bytes(cfg, dp) * norm + 4 * fp32


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
        size = 4 if cfg.train.precision == "fp32" or (norm_input and not _stream16(cfg, dp)) else 2
        out += width[t] * (1 if cuda else size)
        if t == "mlp_up" and gated and not masks_only:  # (the second A's own dropped input)
            out += _values_bytes(cfg, dp, m.n_embd / seq)
        if t == "attn_out" and not masks_only:  # (the dropped copy of the attention's output)
            out += _values_bytes(cfg, dp, width[t])
    return out


def _attention_output_kept(cfg: Config) -> bool:
    """Whether the attention's output is kept by the projection after it (its weight trains, or its LoRA's A reads
    it undropped), not only by the attention kernel: what selective checkpointing, which recomputes the kernel,
    leaves saved."""
    f = cfg.peft
    return f.method == "none" or (f.method in ("lora", "qlora") and "attn_out" in f.targets and f.dropout == 0)


def _attention_core_bytes(cfg: Config, *, tp: int, dp: int) -> float:
    """Bytes per token of a block that selective checkpointing does not keep: the kernel's log-sum-exp, and its
    output where nothing after it keeps that (`_attention_output_kept`)."""
    m = cfg.model
    out = 0.0 if _attention_output_kept(cfg) else m.n_head * m.head_dim / tp
    return _values_bytes(cfg, dp, out, 0.0, m.n_head / tp)


def _first_trained(cfg: Config) -> str | None:
    """Block 0's first layer that trains under PEFT (its input needs no gradient up to there): the first LoRA
    target in the order the block runs them (qkv, attn_out, mlp_up, mlp_down), "adapter" for adapters (after the
    attention); None without PEFT, without a LoRA in the block, or an MoE block 0 whose LoRAs are all in its MLP
    part (moe.py's; not taken off: an upper bound)."""
    f, m = cfg.peft, cfg.model
    lora = set(f.targets) if f.method in ("lora", "qlora") else set()
    order = ["adapter"] if f.method == "adapter" else [t for t in ("qkv", "attn_out", "mlp_up", "mlp_down") if t in lora]
    if not order or (m.is_moe_block(0) and order[0] not in ("qkv", "attn_out", "adapter")):
        return None  # (an MoE block's attention is a dense block's; its MLP part is moe.py's)
    return order[0]


def _first_block_unsaved_bytes(cfg: Config, *, tp: int, dp: int, sequence_parallel: bool) -> float:
    """Bytes per token that block 0 does not save under PEFT, against `_layer_bytes`. PEFT freezes the
    embeddings and the norms, so the residual stream entering block 0 needs no gradient, and autograd keeps
    nothing for an op none of whose inputs needs one: every value before the block's first trained layer goes
    unsaved. Under LoRA/QLoRA that is its first LoRA (qkv, then attn_out, mlp_up, mlp_down, in the order the block
    runs them), whose dropout keeps no mask; with adapters the one after the attention (ln_1 and the attention
    save nothing). The first trained layer keeps its input whatever (counted in `our_layer_values`); after it the
    stream needs a gradient again and the rest of the model saves as counted. Checked against the activation meter
    for each first target and for adapters (tests/test_memory.py). Not taken off (an upper bound there): a first
    block that holds no LoRA, or is MoE with none on its attention, full activation checkpointing (which keeps
    block inputs instead). Under selective checkpointing what `_attention_core_bytes` takes off every block is not
    taken again. Only the first pipeline stage holds block 0."""
    m = cfg.model
    first = _first_trained(cfg)
    if first is None:
        return 0.0
    seq = tp if sequence_parallel else 1
    rms = m.norm == "rmsnorm"
    q, kv = attention_widths(cfg, tp)
    norm_in = m.n_embd / seq  # (as `our_layer_values`: its input; a frozen RMSNorm keeps no normalised output)
    stats = (1 if rms else 2) / seq
    selective = cfg.train.activation_checkpointing == "selective"
    low, norm, lse, norm_stats = 0.0, norm_in, 0.0, stats  # ln_1
    if first != "qkv":  # attention: q, k, v (and RoPE's rotated q, k), the log-sum-exp; its output unless kept
        low += q + 2 * kv + (q + kv if m.pos_emb == "rope" else 0)
        low += q if first != "attn_out" and not (selective and not _attention_output_kept(cfg)) else 0
        lse += 0 if selective else m.n_head / tp
    if first in ("mlp_up", "mlp_down"):
        norm, norm_stats = norm + norm_in, norm_stats + stats  # ln_2
    if first == "mlp_down":  # the activation's saved values (gate, silu, up / up)
        low += (3 if m.mlp == "swiglu" else 1) * m.ffn_hidden / tp
    # the first LoRA's dropout keeps no mask; attn_out's dropped copy is the only one (the attention keeps nothing)
    return (_values_bytes(cfg, dp, low, norm, lse) + _norm_stat_bytes(cfg, dp) * norm_stats
            + _lora_dropout_bytes(cfg, [first], tp=tp, dp=dp, seq=seq, masks_only=first != "attn_out" or selective))


def _ring_attention_bytes(cfg: Config, *, tp: int, dp: int) -> float:
    """Bytes per token a block whose attention input needs a gradient saves under context parallelism beyond
    `_layer_bytes`' count (SDPA's). Ring attention (parallel/context_parallel/ring.py) keeps contiguous q, k and v
    of its own (RoPE's outputs are already; v, and without RoPE q and k, are copied out of the qkv output, which
    then nobody keeps) and its output, which the projection does not share (it keeps a transposed copy, where it
    keeps its input: `_attention_output_kept`). Under selective checkpointing the ring is recomputed and what
    stays is SDPA's. Measured with scripts/saved_tensors_by_op.py under torchrun."""
    if cfg.train.activation_checkpointing == "selective":
        return 0.0
    m = cfg.model
    q, kv = attention_widths(cfg, tp)
    low = (q if _attention_output_kept(cfg) else 0.0) - (q + kv if m.pos_emb == "rope" else 0.0)
    return _values_bytes(cfg, dp, low)


def _rope_table_bytes(cfg: Config, cp: int) -> int:
    """Bytes of RoPE's cos and sin gathered at a context-parallel rank's positions (fp32, positions x head size):
    one pair shared by every block and micro-batch (model/positions.py keeps it), saved by each block's rotation.
    Under train.compile each block's graph gathers its own (not counted); under full checkpointing the kept pair
    is no activation (the blocks' recomputation saves it)."""
    m = cfg.model
    return 2 * (m.block_size // cp) * m.head_dim * 4 if m.pos_emb == "rope" and cp > 1 else 0


def activation_bytes(cfg: Config, *, tp: int, pp: int, pp_rank: int, dp: int, worst: bool = False,
                     cp: int = 1) -> int:
    """Peak bytes saved for backward on this rank: its stage's layers for the micro-batches in flight (MoE
    blocks at the balanced routed load, or with `worst` every ep rank's routed tokens on this one). A
    context-parallel rank holds block_size/cp tokens of each sequence, and saves only those (ring attention keeps
    its own q, k, v, output and log-sum-exp, no other rank's blocks)."""
    m, t, p = cfg.model, cfg.train, cfg.parallel
    sp = p.sequence_parallel and tp > 1
    tokens = t.micro_batch_size * m.block_size // cp
    # (the parameters' dtype follows the data-parallel form, which shards over dp x cp; micro-batches over dp)
    zdp, world = dp * cp, dp * cp * tp * pp
    layer = _layer_bytes(cfg, tp=tp, dp=zdp, sequence_parallel=sp, world=world)
    blocks = _blocks(cfg, pp, pp_rank)
    layers = len(blocks)
    n_moe = sum(1 for i in blocks if m.is_moe_block(i))
    moe_layer = (_moe_layer_bytes(cfg, tp=tp, dp=zdp, sequence_parallel=sp, worst=worst, world=world)
                 if n_moe else 0.0)
    mode = t.activation_checkpointing
    if mode == "full":  # each block keeps its input (its recomputation in backward is a temporary)
        per_micro = layers * m.n_embd / (tp if sp else 1) * 4
    elif mode == "selective":  # only the attention core is recomputed: its log-sum-exp (and output) go
        per_micro = (layers - n_moe) * layer + n_moe * moe_layer - layers * _attention_core_bytes(cfg, tp=tp, dp=zdp)
    else:
        per_micro = (layers - n_moe) * layer + n_moe * moe_layer
    tables = 0
    if cp > 1 and mode != "full":  # (not block 0's attention where its input needs no gradient: it keeps nothing)
        quiet = pp_rank == 0 and _first_trained(cfg) not in (None, "qkv")
        per_micro += (layers - quiet) * _ring_attention_bytes(cfg, tp=tp, dp=zdp)
        tables = _rope_table_bytes(cfg, cp) if layers > quiet else 0
    if pp_rank == 0 and mode != "full":
        per_micro -= _first_block_unsaved_bytes(cfg, tp=tp, dp=zdp, sequence_parallel=sp)
    if pp_rank == pp - 1:
        per_micro += _head_bytes(cfg, tp, zdp, sequence_parallel=sp)
    if pp_rank == 0:
        per_micro += _ids_bytes(cfg, tp)
    in_flight = _in_flight(cfg, pp=pp, pp_rank=pp_rank, dp=dp)
    # (under full checkpointing the blocks' copies are made again in their recomputation: a temporary; the head
    # is not checkpointed)
    copies = autocast_weight_copy_bytes(cfg, tp=tp, pp=pp, pp_rank=pp_rank, dp=zdp, world=world,
                                        head_only=mode == "full")
    copies += _norm_weight_copy_bytes(cfg, dp=zdp, world=world,  # (2 a block, recomputed under full checkpointing)
                                      norms=(0 if mode == "full" else 2 * layers) + (pp_rank == pp - 1))
    held = per_micro * in_flight + (copies * in_flight + tables) / tokens
    if p.pp_schedule == "zb1" and pp > 1 and pp_rank == pp - 1:
        # a micro-batch past its B keeps the graph below its weight ops only: the loss's log-softmax and targets
        # above the LM head are freed at B (executor.py), so all but the one in its forward hold less (under PEFT
        # with a frozen head more is freed: an upper bound there)
        held -= (in_flight - 1) * _loss_bytes(cfg, tp)
    return round(held * tokens)
