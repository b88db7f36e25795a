"""What a zero-bubble schedule holds beyond the activations: the state of each W still to run.

A split stage's B records, at every op of its graph that computes a weight (a linear's matmul, a norm's scale),
the gradient of that op's output, and W later starts there (parallel/pipeline/split_backward.py). An ordinary
backward frees each such gradient as soon as the op has used it; here it lives from B to W, beside the graph
(which B's retain_graph keeps whole, so the held micro-batches count as `memory.activation_bytes` counts them).
ZB-H1's stage s has at most s + 1 of them at once (schedule.peak_pending_weights), at the same moment as its
peak of graphs. The first stage is not split (its input is token ids: W runs the whole backward right after
an empty B), so it holds nothing extra.
"""

from __future__ import annotations

from dist_llm.config import Config
from dist_llm.memory.activations import attention_widths


def pending_values(cfg: Config, tp: int, *, blocks: int, last: bool) -> tuple[float, float] | None:
    """Values per token of one pending W on a stage of `blocks` dense blocks (and the final norm and LM head when
    `last`): (matmul-output gradients, in the compute dtype under autocast; norm-output gradients, in the residual
    stream's dtype). None where this count does not apply (MoE blocks, PEFT: other ops carry the weights)."""
    m = cfg.model
    if m.n_experts or cfg.peft.method != "none":
        return None
    q, kv = attention_widths(cfg, tp)
    hidden = m.ffn_hidden / tp
    # column-parallel outputs are 1/tp; a row-parallel output's gradient is the whole width (its all-reduce's
    # backward is the identity); a bias is added in the same op as its matmul, or takes the same gradient
    low = q + 2 * kv + m.n_embd + (2 if m.mlp == "swiglu" else 1) * hidden + m.n_embd  # qkv, proj, up (+gate), down
    high = 2 * m.n_embd  # the two norms' outputs
    low, high = blocks * low, blocks * high
    if last:
        low += m.padded_vocab / tp  # the logits (vocabulary-parallel under tp)
        high += m.n_embd  # the final norm
    return low, high


def pending_weight_bytes(cfg: Config, *, tp: int, pp: int, pp_rank: int, dp: int, blocks: int,
                         params16: bool) -> int | None:
    """Bytes of pending W state on this stage at its peak (0 for schedules without W; None: not counted)."""
    t, p = cfg.train, cfg.parallel
    if pp == 1 or p.pp_schedule != "zb1" or pp_rank == 0:
        return 0
    values = pending_values(cfg, tp, blocks=blocks, last=pp_rank == pp - 1)
    if values is None:
        return None
    from dist_llm.parallel.pipeline.schedule import peak_pending_weights, zb1

    micro = t.global_batch_size // (t.micro_batch_size * dp)
    count = peak_pending_weights(zb1(pp, micro)[pp_rank])
    low, high = values
    fp32 = t.precision == "fp32"
    per_token = (4 if fp32 else 2) * low + (4 if fp32 or not params16 else 2) * high
    return round(count * per_token * t.micro_batch_size * cfg.model.block_size)
