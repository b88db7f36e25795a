"""`dist-llm memory --suggest`: every layout of a world size, counted analytically and ranked by a stated cost.

Candidates: every (dp, tp, pp) with dp*tp*pp = world size that the config's validation accepts (tp divides
the heads, the KV heads, the padded vocabulary, the MLP width and, with sequence parallelism, the sequence;
pp at most n_layer; the forms MoE allows; the config's parallel.ep kept, not
searched: expert parallelism's all-to-all is not in the cost model yet); each ZeRO stage the layout allows
(one at dp=1: they are the same there); each micro-batch size that divides a rank's share of the global batch (up to 64); each
activation-checkpointing mode. Nothing is built per candidate: the model's parameter shapes come from one
meta-device build (params.py's `_model_params`), and each (dp, tp, pp, stage, ZeRO) is counted once.

Memory: `predict`'s own count (peak.py), unchanged (a test compares every candidate with it).

Cost model, the ranking (`cost_model`, printed as the output's header): a candidate must fit the memory
budget; then the one with the least estimated step time comes first,
    step = compute + bubble + communication, nothing overlapped:
    compute        model FLOPs per token (N: the active parameters, k/E of an MoE layer's experts; 2N
                   forward, 2N backward to activations, 2N_trained to weights, the attention core 4*s*h per
                   layer forward and twice that backward, recomputation: a second forward with full
                   checkpointing, the attention core again with selective) x tokens per step / world size
                   / FLOPS
    bubble         compute x b/(1-b), b the idle share of a step under the config's schedule with m micro-batches
                   per step and equal stages (pipeline/schedule.py's bubble_fraction): (pp-1)/(m+pp-1) for 1F1B
                   and GPipe (compute x (pp-1)/m), (pp-1)/(v*m+pp-1) interleaved with v chunks, ZB-H1's
                   (pp-1)/(3m+pp-1) with its exchanges overlapped (the default; 2(pp-1)/(3m+2(pp-1)) waiting for
                   them; for m < pp the simulator's figure)
    communication  bytes a rank sends per step / bandwidth (NODE_BANDWIDTH for a group whose ranks share a
                   node, --gpus-per-node of them, BANDWIDTH for one that spans nodes; ranks numbered tp
                   innermost, then pp, dp outermost) + LATENCY per collective or point-to-point send, counted as
                   parallel/comm.py counts them (ring all-reduce 2(n-1)/n of the tensor, all-gather (n-1) x the input,
                   reduce-scatter (n-1)/n of the input, p2p the tensor), for the busiest pipeline stage:
      DDP            all-reduce of the fp32 gradients once per step (after the last micro-step)
      ZeRO-1         reduce-scatter of the accumulated gradients once, all-gather of the parameters once
      ZeRO-2         reduce-scatter of each micro-step's gradients (compute dtype) at EVERY micro-step,
                     all-gather of the parameters once
      ZeRO-3 (FSDP2) all-gather of every unit's parameters in forward and again in backward (an untied
                     embedding only in forward) and reduce-scatter of the fp32 gradients, at EVERY micro-step;
                     under pp each unit gathered and reduce-scattered once per step (kept gathered, the default)
      tp             per block and micro-batch, each column layer (qkv; up, and gate for SwiGLU) all-reduces
                     its input's gradient and each row layer (proj, down) its output: b*s*h each (with
                     sequence parallelism an all-gather and a reduce-scatter instead, the same bytes); the
                     vocabulary-parallel embedding and head; full recomputation repeats the forward's
      pp             each micro-batch's activations forward and their gradients backward, b*s*h each
      clipping       the gradient norm's two floats over dp (sharded forms), pp and tp
The counting lives in comm.py. The counts are exact: tests compare them, kind by kind and to the byte, with
parallel/comm.py's counters on 2-rank runs with gradient accumulation (DDP, ZeRO-1/2, FSDP2 tied and untied; tp
with and without sequence parallelism; pp; fp32 and bf16). Left approximate: DDP's buckets are counted as one (a
rounding of under a byte each), SP's replicated gradients under ZeRO are counted whole (each rank reduces its
shard's piece), DeepSpeed's engine by volume. FLOPS, the bandwidths and LATENCY are assumptions stated here, not
measurements: the ranking, not the times, is the point.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from dataclasses import dataclass
from typing import Any, Iterator

from dist_llm.config import (Config, ConfigError, ModelConfig, _check_finetuning, _check_grad_accum_dtype, _check_moe,
                             _check_pipeline, _check_tensor_parallel, overlap_p2p)
from dist_llm.memory import moe as memory_moe
from dist_llm.memory.activations import activation_bytes
from dist_llm.memory.comm import BANDWIDTH, GPUS_PER_NODE, LATENCY, NODE_BANDWIDTH, Comm, step_comm
from dist_llm.memory.estimate import Estimate, GiB
from dist_llm.memory.model_states import model_state_bytes
from dist_llm.memory.params import _model_params
from dist_llm.memory.transients import init_transient_bytes, pipelined_zero3_bytes, temporary_bytes

FLOPS = 200e12  # achieved per device (about 40-60% of an H100's dense bf16 peak)
MAX_MICRO = 64
CHECKPOINTING = ("none", "selective", "full")

def cost_model(gpus_per_node: int = GPUS_PER_NODE) -> str:
    """The ranking in one paragraph, printed as the output's header."""
    return (f"ranked by estimated step time = compute + pipeline bubble + communication (not overlapped), "
            f"assuming {FLOPS / 1e12:.0f} TFLOP/s per device, {NODE_BANDWIDTH / 1e9:.0f} GB/s per rank within a "
            f"node of {gpus_per_node} devices and {BANDWIDTH / 1e9:.0f} GB/s across nodes (tp groups are "
            f"consecutive ranks, then pp, dp outermost), {LATENCY * 1e6:.0f} us per call; bubble of the config's "
            f"pipeline schedule for m micro-batches (1F1B: (pp-1)/(m+pp-1) of the step); ZeRO-2 reduce-scatters and "
            f"FSDP2 gathers at every micro-step")


@dataclass
class Suggestion:
    cfg: Config
    est: Estimate
    comm: Comm
    bubble: float  # fraction of the step a stage idles
    compute_s: float
    bubble_s: float
    comm_s: float
    this_config: bool = False

    @property
    def step_s(self) -> float:
        return self.compute_s + self.bubble_s + self.comm_s

    @property
    def layout(self) -> tuple[int, int, int]:
        p = self.cfg.parallel
        return p.dp, p.tp, p.pp

    @property
    def needs_bytes(self) -> int:
        """What must fit: the training peak, or the build's where it is higher (native ZeRO-1/2 casting a loaded
        fp32 model into its flat buffer)."""
        return max(self.est.peak_bytes, self.est.build_peak_bytes)

    def reason(self, budget: int) -> str:
        fits = "fits" if self.needs_bytes <= budget else "does not fit"
        build = self.est.build_peak_bytes
        built = f" (building: {build / GiB:.3g})" if build > self.est.peak_bytes else ""
        return (f"{fits}: peak {self.est.peak_bytes / GiB:.3g}{built} of {budget / GiB:.3g} GiB; comm "
                f"{_size(self.comm.total)}/step in {self.comm.calls} calls ({_time(self.comm_s)}); bubble "
                f"{100 * self.bubble:.1f}% ({_time(self.bubble_s)}); compute {_time(self.compute_s)}")


@dataclass
class Plan:
    world_size: int
    budget: int
    fits: list[Suggestion]  # every fitting variant, best first
    layouts: list[tuple[Suggestion, int]]  # the best variant of each (dp, tp, pp), best first, and how many fit
    variants: int  # candidates counted (fitting or not)
    this_layout: tuple[int, int, int] | None  # the config's (dp, tp, pp), if a candidate at this world size
    this_config: Suggestion | None  # the config's own variant as given (None if the world size cannot run it)
    smallest: Suggestion | None  # the candidate with the least peak (to say what is closest when none fits)
    gpus_per_node: int = GPUS_PER_NODE


def _size(n: float) -> str:
    for unit, factor in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= factor:
            return f"{n / factor:.2f} {unit}"
    return f"{n:.0f} B"


def _time(seconds: float) -> str:
    return (f"{seconds:.3g} s" if seconds >= 1 else f"{seconds * 1e3:.3g} ms" if seconds >= 1e-3
            else f"{seconds * 1e6:.3g} us")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


# -- compute and bubble -----------------------------------------------------------------------------------
def compute_seconds(cfg: Config, world_size: int) -> float:
    m, t = cfg.model, cfg.train
    params = _model_params(cfg)

    def active(name: str, shape: tuple[int, ...]) -> float:  # a token meets k of an MoE layer's E experts
        return math.prod(shape) * (m.moe_top_k / m.n_experts if memory_moe.is_expert(name) else 1)

    n = sum(active(name, s) for name, s, _ in params)
    trained = sum(active(name, s) for name, s, g in params if g)
    attention = 4 * m.block_size * m.n_embd * m.n_layer  # QK^T and AV, forward, per token
    forward = 2 * n + attention
    per_token = forward + (2 * n + 2 * attention) + 2 * trained
    if t.activation_checkpointing == "full":
        per_token += forward
    elif t.activation_checkpointing == "selective":
        per_token += attention
    return per_token * t.global_batch_size * m.block_size / world_size / FLOPS


def bubble_fraction(cfg: Config, micro_steps: int) -> float:
    """The share of a step a stage idles under the config's pipeline schedule, stages equal."""
    p = cfg.parallel
    return _schedule_bubble(p.pp, micro_steps, p.pp_schedule, p.pp_virtual, overlap_p2p(cfg)) if p.pp > 1 else 0.0


@functools.lru_cache(maxsize=None)  # (ZB-H1 with fewer micro-batches than stages runs the simulator)
def _schedule_bubble(pp: int, micro_steps: int, schedule: str, chunks: int, overlap: bool) -> float:
    from dist_llm.parallel.pipeline.schedule import bubble_fraction as of_schedule

    return of_schedule(pp, micro_steps, schedule=schedule, chunks=chunks, overlap=overlap)  # (chunks: 1 but interleaved)


# -- candidates -------------------------------------------------------------------------------------------
def _reduce_settings(cfg: Config, *, zero: int, pp: int) -> tuple[str, ...]:
    """`parallel.pp_reduce_grads` settings tried: both for ZeRO-3 under a pipeline (once a step holds the stage's
    fp32 gradient whole, per micro-batch m times the reduce-scatters), where the schedule allows them (not zb1)."""
    if zero == 3 and pp > 1 and cfg.parallel.pp_schedule != "zb1":
        return ("step", "micro_batch")
    return ("step",)


def _with(cfg: Config, *, dp: int, tp: int, pp: int, zero: int, micro: int, ckpt: str,
          reduce: str | None = None) -> Config:
    p = cfg.parallel
    parallel = dataclasses.replace(
        p, dp=dp, tp=tp, pp=pp, zero_stage=zero, pp_layers=p.pp_layers if pp == p.pp else [],
        pp_virtual=p.pp_virtual if pp > 1 else 1,  # (interleaving's chunks: a pipeline's, refused at pp=1)
        pp_overlap_p2p=p.pp_overlap_p2p if pp > 1 else None,  # (a pipeline's setting: nothing to refuse at pp=1)
        offload=p.offload if zero == 3 else "none",
        # (FSDP2's under a pipeline: the other stages and pp=1 refuse it)
        pp_reduce_grads=reduce or (p.pp_reduce_grads if zero == 3 and pp > 1 else "step"),
        grad_accum_dtype=p.grad_accum_dtype if zero in (1, 2) else "fp32")
    train = dataclasses.replace(cfg.train, micro_batch_size=micro, activation_checkpointing=ckpt)
    return dataclasses.replace(cfg, parallel=parallel, train=train)


_LAYOUT_RULES = (_check_grad_accum_dtype, _check_tensor_parallel, _check_pipeline, _check_finetuning, _check_moe)


def _accepted(c: Config) -> bool:
    """Whether the config's validation accepts this candidate (the rules that involve the layout: the rest of
    config.validate passed when the config loaded)."""
    try:
        for check in _LAYOUT_RULES:
            check(c)
    except ConfigError:
        return False
    return True


def _micro_batches(cfg: Config, dp: int) -> list[int]:
    """The micro-batch sizes tried at dp: the divisors of a rank's share of the global batch, up to MAX_MICRO (and
    the config's own)."""
    t = cfg.train
    return [d for d in _divisors(t.global_batch_size // dp) if d <= MAX_MICRO or d == t.micro_batch_size]


def layouts(cfg: Config, world_size: int) -> Iterator[tuple[int, int, int, int]]:
    """(dp, tp, pp, zero stage) the config's validation accepts at this world size with some micro-batch size
    (interleaving needs the micro-batches per step to be a multiple of pp)."""
    t = cfg.train
    for tp in _divisors(world_size):
        for pp in _divisors(world_size // tp):
            dp = world_size // (tp * pp)
            if t.global_batch_size % dp:
                continue
            zeros = (0, 1, 2, 3) if dp > 1 else (0,)
            if dp == 1 and cfg.parallel.zero_stage == 3:  # (FSDP2 over one rank: at pp > 1 too, where it holds the
                zeros = (0, 3)                               # stage's part whole through the step)
            for zero in zeros:
                if any(_accepted(_with(cfg, dp=dp, tp=tp, pp=pp, zero=zero, micro=micro,
                                       ckpt=t.activation_checkpointing)) for micro in _micro_batches(cfg, dp)):
                    yield dp, tp, pp, zero


def suggest(cfg: Config, world_size: int, budget: int, gpus_per_node: int = GPUS_PER_NODE) -> Plan:
    """Every candidate layout of `world_size` ranks counted; those whose peak fits `budget`, best first."""
    t, p = cfg.train, cfg.parallel
    if p.cp > 1:  # (it took dp = world / (tp*pp) as if cp were 1, and priced no ring exchange)
        raise ConfigError(f"parallel.cp: --suggest searches dp x tp x pp without context parallelism (its ring's "
                          f"exchanges are not in the cost model), got cp={p.cp}; `dist-llm memory` without --suggest "
                          f"counts this layout")
    states: dict[tuple[int, ...], Estimate] = {}
    comms: dict[tuple[Any, ...], Comm] = {}
    builds: dict[tuple[int, ...], int] = {}  # the build's transient per (dp, tp, pp, zero), as predict's
    computes: dict[str, float] = {}
    own_dp = p.dp or world_size // (p.tp * p.pp)
    own = (own_dp, p.tp, p.pp, 0 if own_dp == 1 and p.zero_stage in (1, 2) else p.zero_stage, t.micro_batch_size,
           t.activation_checkpointing, p.pp_reduce_grads)  # (ZeRO-1/2 on one dp rank are plain: counted as stage 0)
    everything: list[Suggestion] = []
    for dp, tp, pp, zero in layouts(cfg, world_size):
        for micro, ckpt, reduce in itertools.product(_micro_batches(cfg, dp), CHECKPOINTING,
                                                     _reduce_settings(cfg, zero=zero, pp=pp)):
            c = _with(cfg, dp=dp, tp=tp, pp=pp, zero=zero, micro=micro, ckpt=ckpt, reduce=reduce)
            if not _accepted(c):  # (interleaving: a micro-batch count that is not a multiple of pp)
                continue
            est = None
            for s in range(pp):  # as predict: the stage that needs the most
                key = (dp, tp, pp, s, zero)
                if key not in states:
                    states[key] = model_state_bytes(c, dp=dp, tp=tp, pp=pp, pp_rank=s)
                e = dataclasses.replace(states[key], notes=[])
                e.activation_bytes = activation_bytes(c, tp=tp, pp=pp, pp_rank=s, dp=dp)
                e.temporary_bytes = max(e.temporary_bytes, temporary_bytes(c, dp=dp, tp=tp, pp=pp, pp_rank=s))
                e.temporary_bytes += pipelined_zero3_bytes(c, tp=tp, pp=pp, pp_rank=s)
                e.offloaded = c.parallel.offload == "cpu"
                builds_key = (dp, tp, pp, zero)
                if builds_key not in builds:
                    builds[builds_key] = init_transient_bytes(c, dp=dp, pp=pp)
                e.init_transient_bytes = builds[builds_key]
                if est is None or e.peak_bytes > est.peak_bytes:
                    est = e
            assert est is not None
            m = t.global_batch_size // (micro * dp)
            comm = max((_cached_comm(comms, c, dp, tp, pp, s, zero, micro, ckpt, reduce) for s in range(pp)),
                       key=lambda x: x.total)
            if ckpt not in computes:
                computes[ckpt] = compute_seconds(c, world_size)
            compute = computes[ckpt]
            bubble = bubble_fraction(c, m)
            everything.append(Suggestion(
                cfg=c, est=est, comm=comm, bubble=bubble, compute_s=compute,
                bubble_s=compute * bubble / (1 - bubble),
                comm_s=comm.seconds(world=world_size, tp=tp, pp=pp, gpus_per_node=gpus_per_node),
                this_config=(dp, tp, pp, zero, micro, ckpt, c.parallel.pp_reduce_grads) == own))
    fits = sorted((s for s in everything if s.needs_bytes <= budget), key=lambda s: (s.step_s, s.est.peak_bytes))
    best: dict[tuple[int, int, int], list[Any]] = {}
    for s in fits:
        best.setdefault(s.layout, [s, 0])[1] += 1
    mine = [s for s in everything if s.layout == own[:3]]  # the config's (dp, tp, pp), any variant
    exact = next((s for s in mine if s.this_config), None)
    return Plan(world_size=world_size, budget=budget, fits=fits, layouts=[(s, n) for s, n in best.values()],
                variants=len(everything), this_layout=own[:3] if mine else None, this_config=exact,
                smallest=min(everything, key=lambda s: s.needs_bytes, default=None), gpus_per_node=gpus_per_node)


def _cached_comm(cache: dict[tuple[Any, ...], Comm], c: Config, dp: int, tp: int, pp: int, s: int, zero: int,
                 micro: int, ckpt: str, reduce: str) -> Comm:
    key = (dp, tp, pp, s, zero, micro, ckpt == "full", reduce)
    if key not in cache:
        cache[key] = step_comm(c, dp=dp, tp=tp, pp=pp, pp_rank=s)
    return cache[key]


# -- a model of a given size --------------------------------------------------------------------------------
def _approx_params(m: ModelConfig) -> int:
    """Parameters of a GPT of this shape (biases and norms included), without building it."""
    h, hd, kv = m.n_embd, m.head_dim, m.kv_heads
    bias = 1 if m.bias else 0
    norm = h * (2 if m.norm == "layernorm" and m.bias else 1)
    attn = h * (h + 2 * kv * hd) + bias * (h + 2 * kv * hd) + h * h + bias * h
    f = m.ffn_hidden
    mlp = (3 * h * f if m.mlp == "swiglu" else 2 * h * f) + bias * (f + h)
    embed = m.padded_vocab * h * (1 if m.tie_embeddings else 2) + (m.block_size * h if m.pos_emb == "learned" else 0)
    return m.n_layer * (attn + mlp + 2 * norm) + embed + norm


def scale_model(m: ModelConfig, params: float) -> ModelConfig:
    """The config's architecture (head width, norm, MLP, positions, vocabulary, GQA ratio) at about `params`
    parameters: n_layer and n_embd grown together, keeping the config's n_embd / n_layer (at least 32, so a
    narrow toy's proportions do not make a billion-parameter model a hundred layers deep), n_head a multiple of
    4 from 8 and of 8 from 16 (so that it splits over tensor-parallel degrees)."""
    if params <= 0:
        raise ConfigError(f"memory: --params must be positive, got {params:g}")
    hd = m.head_dim
    ratio = max(32.0, m.n_embd / m.n_layer)
    group = m.n_head // m.kv_heads
    best: tuple[float, ModelConfig] | None = None
    for layers in range(1, 257):
        ideal = ratio * layers / hd  # heads at the config's proportions; a few either side, in steps of 4 from 8, of 8 from 16
        for heads in {max(group, h - h % group) for h in range(max(1, int(ideal * 0.5)), int(ideal * 2) + 9)
                      if h < 8 or h % (4 if h < 16 else 8) == 0}:
            c = dataclasses.replace(m, n_layer=layers, n_head=heads, n_embd=heads * hd, mlp_hidden=0,
                                    n_kv_head=heads // group if m.n_kv_head else 0)
            # the size first; among sizes within a few percent, the proportions
            error = abs(math.log(_approx_params(c) / params)) + 0.02 * abs(math.log(heads * hd / layers / ratio))
            if best is None or error < best[0]:
                best = (error, c)
    assert best is not None
    return best[1]


# -- presentation -------------------------------------------------------------------------------------------
def _zero(p: Any) -> str:
    """The ZeRO stage as the table shows it: `3/mb` for ZeRO-3 reducing per micro-batch under a pipeline."""
    return f"{p.zero_stage}{'/mb' if p.pp_reduce_grads == 'micro_batch' else ''}"


_MB_LEGEND = ("zero 3/mb: parallel.pp_reduce_grads=micro_batch (the stage's gradients reduce-scattered after every "
              "micro-batch, not held whole to the step's end)")


def _row(s: Suggestion, budget: int, variants: int, mark: str = "") -> str:
    p, t = s.cfg.parallel, s.cfg.train
    return (f"{p.dp:>4}{p.tp:>4}{p.pp:>4}{_zero(p):>6}{t.activation_checkpointing:>11}{t.micro_batch_size:>7}"
            f"{variants:>9}{_time(s.step_s):>11}  {s.reason(budget)}{mark}")


def format_plan(plan: Plan, *, top: int, memory_text: str) -> str:
    n = len(plan.layouts)
    shown = plan.layouts[:top]
    printed: list[Suggestion] = []  # the candidates a line shows (the legend of `3/mb` where one is)
    lines = [f"{plan.variants} variants of {plan.world_size} ranks counted (dp x tp x pp, ZeRO stage, micro batch, "
             f"checkpointing, ZeRO-3's gradient reduction under pp); {len(plan.fits)} fit {memory_text} per rank, in "
             f"{n} distinct layouts (dp x tp x pp)",
             f"cost model: {cost_model(plan.gpus_per_node)}"]
    header = (f"{'dp':>4}{'tp':>4}{'pp':>4}{'zero':>6}{'ckpt':>11}{'micro':>7}{'variants':>9}{'est. step':>11}"
              "  why")
    if not shown:
        lines.append("none fits: more ranks, a smaller micro batch or a smaller model")
        if plan.smallest is not None:
            lines += ["the smallest peak:", header, _row(plan.smallest, plan.budget, 0)]
            printed.append(plan.smallest)
    else:
        lines += [f"showing the best variant of each of the top {len(shown)} layouts ({n - len(shown)} cut; --top N "
                  f"to see more):", header]
        for s, count in shown:
            lines.append(_row(s, plan.budget, count, "  <- this config's layout" if s.layout == plan.this_layout
                              else ""))
            printed.append(s)
    dp_tp_pp = " x ".join(f"{k}{v}" for k, v in zip(("dp", "tp", "pp"), plan.this_layout or ()))
    if plan.this_layout is None:
        lines.append(f"this config's layout (tp x pp) does not divide {plan.world_size} ranks, or the config's rules "
                     "refuse it there")
    elif not any(s.layout == plan.this_layout for s, _ in shown):
        rank = next((i + 1 for i, (s, _) in enumerate(plan.layouts) if s.layout == plan.this_layout), None)
        lines.append(f"this config's layout, {dp_tp_pp}: " + (f"ranked {rank} of {n}; its best variant:" if rank
                                                                else f"no variant fits {memory_text}"))
        if rank:
            s, count = plan.layouts[rank - 1]
            lines.append(_row(s, plan.budget, count))
            printed.append(s)
    own = plan.this_config
    if own is not None:
        printed.append(own)
    if own is None and plan.this_layout is not None:
        lines.append(f"as configured it cannot run on {plan.world_size} ranks: the micro batch, ZeRO stage or "
                     "checkpointing is not one of this layout's (train.global_batch_size must split into dp x "
                     "train.micro_batch_size)")
    elif own is not None and own.needs_bytes > plan.budget:
        lines.append(f"as configured it needs a peak of {own.needs_bytes / GiB:.3g} GiB: does not fit")
    elif own is not None:
        lines.append(f"as configured (zero {_zero(own.cfg.parallel)}, micro batch {own.cfg.train.micro_batch_size},"
                     f" checkpointing {own.cfg.train.activation_checkpointing}): est. step {_time(own.step_s)}; "
                     + own.reason(plan.budget))
    if any(_zero(s.cfg.parallel).endswith("/mb") for s in printed):
        lines.append(_MB_LEGEND)
    return "\n".join(lines)


def to_json(plan: Plan) -> list[dict[str, Any]]:
    out = []
    for s, count in plan.layouts:
        p, t = s.cfg.parallel, s.cfg.train
        out.append({"dp": p.dp, "tp": p.tp, "pp": p.pp, "zero_stage": p.zero_stage, "pp_reduce_grads": p.pp_reduce_grads,
                    "activation_checkpointing": t.activation_checkpointing, "micro_batch_size": t.micro_batch_size,
                    "variants": count, "comm_bytes_per_step": s.comm.total, "comm_bytes_by_kind": s.comm.bytes,
                    "comm_calls": s.comm.calls, "bubble": s.bubble, "est_step_s": s.step_s,
                    "this_config_layout": s.layout == plan.this_layout,
                    "reason": s.reason(plan.budget), **s.est.to_json()})
    return out
