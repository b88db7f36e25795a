"""`predict`: what one rank needs at its peak, for any config and layout, from the counts of the other modules
(model_states.py, activations.py, transients.py; moe.py's routed-token figures, pipeline.py's pending W's)."""

from __future__ import annotations

from dist_llm.config import Config, reshard_after_forward
from dist_llm.memory import moe as memory_moe
from dist_llm.memory import pipeline as memory_pipeline
from dist_llm.memory.activations import _blocks, _in_flight, activation_bytes, autocast_weight_copy_bytes
from dist_llm.memory.estimate import Estimate
from dist_llm.memory.model_states import model_state_bytes
from dist_llm.memory.params import _params16
from dist_llm.memory.transients import pipelined_zero3_bytes, temporary_bytes, transient_bytes


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
        copies = autocast_weight_copy_bytes(cfg, tp=tp, pp=pp, pp_rank=s, dp=dp * p.cp, world=world,
                                            head_only=cfg.train.activation_checkpointing == "full")
        if copies:
            in_flight = _in_flight(cfg, pp=pp, pp_rank=s, dp=dp)
            est.notes.append(f"activations include autocast's 16-bit copies of the fp32 weights, "
                             f"{copies * in_flight / 2**30:.2f} GiB on stage {s} ({in_flight:g} micro-batch(es) in "
                             "flight): 16-bit parameters (parallel.zero_stage=1/2 or 3 over more than one rank) keep none")
        est.temporary_bytes = max(est.temporary_bytes, temporary_bytes(cfg, dp=dp, tp=tp, cp=p.cp, pp=pp, pp_rank=s))
        held = pipelined_zero3_bytes(cfg, tp=tp, pp=pp, pp_rank=s)
        if held:  # held through the step, beside the activations and the largest transient
            est.temporary_bytes += held
            whole = [] if p.pp_reduce_grads == "micro_batch" else [
                "its gradients accumulated whole in fp32, reduce-scattered once a step; parallel.pp_reduce_grads="
                "micro_batch reduces them per micro-batch instead"]
            if not reshard_after_forward(cfg):
                whole.append("its parameters gathered in the compute dtype from its first forward to its last "
                             "backward; parallel.reshard_after_forward=true regathers them per micro-batch instead")
            est.notes.append(f"ZeRO-3 with pp: {held / 2**20:.2f} MiB held through a step on stage {s} ("
                             + "; and ".join(whole) + ")")
        _pending_weights(est, cfg, dp=dp, tp=tp, pp=pp, pp_rank=s)
        if cfg.model.n_experts:
            _moe_figures(est, cfg, dp=dp, tp=tp, pp=pp, pp_rank=s, ep=ep)
        if cfg.model.dropout > 0:
            est.notes.append(f"model.dropout={cfg.model.dropout:g}: its masks (on the CPU a tensor of the input's dtype, "
                             "and the attention's probabilities where SDPA falls back to its math kernel) are not "
                             "counted in the activations: an underestimate")
        if cfg.model.pos_emb == "alibi" and p.cp == 1:
            est.notes.append("model.pos_emb=alibi: SDPA with a bias (the CPU's math kernel keeps the attention "
                             "probabilities, heads x T x T a sequence and block; CUDA's memory-efficient kernel the "
                             "heads x T x T bias, one shared by the blocks, one a block under train.compile) is not "
                             "counted in the activations: an underestimate (ring attention, parallel.cp > 1, is "
                             "counted)")
        if p.offload == "cpu":
            est.offloaded = True
            est.notes.append("parallel.offload=cpu: parameters, gradients and optimizer states live in host memory "
                             "(host_bytes); the device holds one gathered unit at a time")
        if best is None or est.peak_bytes > best.peak_bytes:
            best = est
    assert best is not None
    best.init_transient_bytes, best.load_transient_bytes, best.export_transient_bytes = transient_bytes(cfg, dp=dp, pp=pp)
    return best


def _pending_weights(est: Estimate, cfg: Config, *, dp: int, tp: int, pp: int, pp_rank: int) -> None:
    pending = memory_pipeline.pending_weight_bytes(cfg, tp=tp, pp=pp, pp_rank=pp_rank, dp=dp,
                                                   blocks=len(_blocks(cfg, pp, pp_rank)), params16=_params16(cfg, dp * cfg.parallel.cp))
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
