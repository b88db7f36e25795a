"""Bytes one rank sends in one training step, per collective kind, counted as parallel/comm.py counts them, for
any layout, without running anything (suggest.py's cost model; its docstring lists what each form sends).
Tests compare these counts, kind by kind and to the byte, with parallel/comm.py's counters on 2-rank runs."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from dist_llm.config import Config, reshard_after_forward
from dist_llm.memory.model_states import zero_buckets
from dist_llm.memory.params import _local_shape, _stage_layers, _stage_params

NODE_BANDWIDTH = 300e9  # bytes a rank sends per second to ranks of its own node (NVLink)
BANDWIDTH = 50e9  # ... to ranks of other nodes (one 400 Gb/s NIC per device)
GPUS_PER_NODE = 8
LATENCY = 20e-6  # seconds per collective call or point-to-point send


@dataclass
class Comm:
    """Bytes one rank sends in one step, by kind as comm.CommStats names them, and the calls."""

    bytes: dict[str, int] = field(default_factory=dict)
    calls: int = 0

    def add(self, kind: str, nbytes: float, calls: int = 1, *, times: int = 1) -> None:
        """`times` collectives of `nbytes` each (rounded each, as CommStats does), `calls` calls each."""
        self.bytes[kind] = self.bytes.get(kind, 0) + times * int(round(nbytes))
        self.calls += times * calls

    @property
    def total(self) -> int:
        return sum(self.bytes.values())

    def by_kind(self) -> dict[str, int]:
        """The bytes by comm.CommStats's kinds (tp's merged in)."""
        out: dict[str, int] = {}
        for k, v in self.bytes.items():
            out[k.removeprefix("tp_")] = out.get(k.removeprefix("tp_"), 0) + v
        return out

    def seconds(self, *, world: int, tp: int, pp: int, gpus_per_node: int = GPUS_PER_NODE) -> float:
        """Each group's bytes at NODE_BANDWIDTH when its ranks share a node, else BANDWIDTH. Ranks are placed
        as the launcher numbers them (ParallelContext.placement): tp innermost (a tp group is tp consecutive
        ranks), then pp (a pipeline spans tp x pp consecutive ranks), dp outermost (it spans the world)."""
        def bandwidth(span: int) -> float:
            return NODE_BANDWIDTH if span <= gpus_per_node else BANDWIDTH

        tp_bytes = sum(v for k, v in self.bytes.items() if k.startswith("tp_"))
        p2p = self.bytes.get("p2p", 0)
        rest = self.total - tp_bytes - p2p  # dp's collectives (and the clipping norm's few floats)
        return (tp_bytes / bandwidth(tp) + p2p / bandwidth(tp * pp) + rest / bandwidth(world)
                + self.calls * LATENCY)


# -- communication ----------------------------------------------------------------------------------------
_BUCKETS: dict[tuple[Any, ...], list[tuple[int, int]]] = {}  # (numel, shard numel) of ZeRO-1/2's buckets
_LOCAL: dict[tuple[Any, ...], list[tuple[str, tuple[int, ...], bool]]] = {}


def _local_params(cfg: Config, *, tp: int, pp: int, pp_rank: int) -> list[tuple[str, tuple[int, ...], bool]]:
    """(name, shape on tp rank 0, requires_grad) of a stage's parameters, remembered per model and layout."""
    key = (repr((cfg.model, cfg.peft, cfg.parallel.pp_layers)), cfg.parallel.pp_virtual, tp, pp, pp_rank)
    if key not in _LOCAL:
        if len(_LOCAL) >= 1024:
            _LOCAL.clear()
            _BUCKETS.clear()  # (keyed by the lists' ids)
        _LOCAL[key] = [(n, _local_shape(n, s, cfg, tp), g) for n, s, g in _stage_params(cfg, pp, pp_rank)]
    return _LOCAL[key]


def _dp_comm(cfg: Config, out: Comm, params: list[tuple[str, tuple[int, ...], bool]], *, dp: int, pp: int,
             micro_steps: int) -> None:
    """The data-parallel form's collectives, exactly as parallel/data/ issues them."""
    p, t = cfg.parallel, cfg.train
    stage = p.zero_stage if dp > 1 or p.zero_stage == 3 else 0
    if dp == 1:
        return
    size = 4 if t.precision == "fp32" else 2  # the compute dtype
    trainable = [(n, s) for n, s, g in params if g]
    ring = (dp - 1) / dp
    if stage == 0:  # DDP (its buckets counted as one), or the flat buffer all-reduced in buckets under a pipeline
        n = sum(math.prod(s) for _, s in trainable)
        if pp == 1:
            out.add("all_reduce", 2 * ring * 4 * n, calls=max(1, -(-4 * n // int(p.bucket_mb * 2**20))))
        else:
            chunk = max(1, int(p.bucket_mb * 2**20 / 4))
            for lo in range(0, n, chunk):
                out.add("all_reduce", 2 * ring * 4 * min(chunk, n - lo))
        return
    if stage in (1, 2) and p.backend == "native":
        from dist_llm.parallel.data.zero import accum_dtype

        key = (id(params), dp, pp, p.bucket_mb, t.precision)
        if key not in _BUCKETS:
            buckets = zero_buckets(cfg, trainable, dp=dp, pp=pp, has_wte=any(n == "wte.weight" for n, _, _ in params))
            _BUCKETS[key] = [(b.numel, b.shard_numel) for b in buckets]
        rs_size, times = (accum_dtype(cfg).itemsize, 1) if stage == 1 else (size, micro_steps)
        for numel, shard in _BUCKETS[key]:
            out.add("reduce_scatter", ring * numel * rs_size, times=times)
            out.add("all_gather", (dp - 1) * shard * size)
        return
    if stage == 3:  # FSDP2: a unit per block, the untied embedding and head each one, the root the rest
        units: dict[str, list[tuple[tuple[int, ...], bool]]] = {}
        untied = not cfg.model.tie_embeddings
        for n, s, g in params:
            top, _, rest = n.partition(".")
            unit = (f"blocks.{rest.partition('.')[0]}" if top == "blocks"
                    else top if untied and top in ("wte", "lm_head") else "root")
            units.setdefault(unit, []).append((s, g))
        reshard = reshard_after_forward(cfg)
        for unit, shapes in units.items():
            shard = sum(-(-s[0] // dp) * math.prod(s[1:]) if s else 1 for s, _ in shapes)
            trained = sum(-(-s[0] // dp) * math.prod(s[1:]) if s else 1 for s, g in shapes if g)
            # gathered in forward and again in backward (fsdp.py reshards the root too), but for the untied
            # embedding, whose backward never reads its table (set_unshard_in_backward(False)); under a pipeline
            # kept gathered from the stage's first forward to its last backward (the default there): once a step
            gathers = 1 if unit == "wte" or not reshard else 2
            out.add("all_gather", (dp - 1) * shard * size, times=1 if pp > 1 and not reshard else gathers * micro_steps)
            if trained:  # (n-1)/n of n shards, reduced in fp32: once a step under a pipeline (fsdp.py), unless
                # parallel.pp_reduce_grads=micro_batch
                once = pp > 1 and cfg.parallel.pp_reduce_grads == "step"
                out.add("reduce_scatter", (dp - 1) * trained * 4, times=1 if once else micro_steps)
        return
    # DeepSpeed's engine: the same volume as ZeRO-1/2's, in its buckets
    n = sum(math.prod(s) for _, s in trainable)
    out.add("reduce_scatter", ring * n * size * (micro_steps if stage == 2 else 1))
    out.add("all_gather", ring * n * size)


def step_comm(cfg: Config, *, dp: int, tp: int, pp: int, pp_rank: int = 0) -> Comm:
    """Bytes dp rank 0 / tp rank 0 of pipeline stage `pp_rank` sends in one step (see the module's docstring)."""
    m, t, p = cfg.model, cfg.train, cfg.parallel
    micro_steps = t.global_batch_size // (t.micro_batch_size * dp)
    params = _local_params(cfg, tp=tp, pp=pp, pp_rank=pp_rank)
    out = Comm()
    _dp_comm(cfg, out, params, dp=dp, pp=pp, micro_steps=micro_steps)
    stage = p.zero_stage if dp > 1 or p.zero_stage == 3 else 0
    first, last = pp_rank == 0, pp_rank == pp - 1
    mixed = t.precision != "fp32"
    compute = 2 if mixed else 4
    params16 = mixed and dp > 1 and stage in (1, 2)  # our ZeRO-1/2 hold 16-bit parameters
    residual = 2 if params16 else 4  # the residual stream's dtype: the parameters'
    tied = [(s, g) for n, s, g in params if n == "wte.weight" and g]
    if pp > 1 and m.tie_embeddings and tied:  # first and last stage sum the tied embedding's gradient (2 ranks)
        numel = math.prod(tied[0][0])
        if stage in (1, 2):  # this rank's piece of its bucket, in the accumulation dtype
            from dist_llm.parallel.data.zero import accum_dtype

            out.add("all_reduce", -(-numel // dp) * accum_dtype(cfg).itemsize)
        elif stage == 3:  # FSDP2: this rank's rows of it, fp32 (rank 0's: the first ceil(rows / dp))
            out.add("all_reduce", -(-tied[0][0][0] // dp) * math.prod(tied[0][0][1:]) * 4)
        else:
            out.add("all_reduce", numel * 4)
    bsh = t.micro_batch_size * m.block_size * m.n_embd
    if tp > 1:
        _tp_comm(cfg, out, params, tp=tp, pp=pp, pp_rank=pp_rank, micro_steps=micro_steps, residual=residual,
                 compute=compute)
    if pp > 1:
        # each of this rank's chunks (interleaved: v of them) sends its activations on and its input's gradient
        # back, but the model's last chunk has nothing to send on and its first no gradient to send back
        chunks = p.pp_virtual if p.pp_schedule == "interleaved" else 1
        sends = 2 * chunks - (1 if last else 0) - (1 if first else 0)
        out.add("p2p", micro_steps * sends * bsh * compute, calls=micro_steps * sends)
        out.add("all_reduce", 2 * (pp - 1) / pp * 8)
    if dp > 1 and stage in (1, 2, 3):
        out.add("all_reduce", 2 * (dp - 1) / dp * 8)  # the norm's two floats over the sharded gradients
    return out


def _tp_comm(cfg: Config, out: Comm, params: list[tuple[str, tuple[int, ...], bool]], *, tp: int, pp: int,
             pp_rank: int, micro_steps: int, residual: int, compute: int) -> None:
    """Tensor parallelism's collectives (parallel/tensor/), per micro-batch: each column input (qkv's; the MLP's,
    one for SwiGLU's gate and up together) all-reduces its gradient in backward and each row layer (proj, down)
    its output in forward; with sequence parallelism a column input is all-gathered in forward (in the compute
    dtype), all-gathered again in backward (only its local slice is saved; not for a frozen base) and its
    gradient reduce-scattered, a row layer the reverse. The vocabulary-parallel embedding reduces its output (SP:
    reduce-scatter, and all-gather in backward), the head gathers its input like a column layer, the
    cross-entropy all-reduces three floats a token; under SP the learned positions gather their gradient. Full
    recomputation repeats the forward's collectives. Once a step, SP's replicated parameters (norms, row biases)
    all-reduce their gradients (fp32; a ZeRO shard's piece under ZeRO, counted whole here) and the gradient
    norm its tp-sharded float. Kinds are prefixed "tp_" (they take NODE_BANDWIDTH); `Comm.by_kind` drops it."""
    m, t, p = cfg.model, cfg.train, cfg.parallel
    first, last = pp_rank == 0, pp_rank == pp - 1
    sp = p.sequence_parallel
    part = (tp - 1) / tp  # an all-gather or reduce-scatter of a whole tensor; an all-reduce is twice that
    bsh = t.micro_batch_size * m.block_size * m.n_embd
    layers = len(_stage_layers(cfg, pp, pp_rank)) if pp > 1 else m.n_layer
    lora = cfg.peft.targets if cfg.peft.method in ("lora", "qlora") else ()
    cols = 3 if m.mlp == "swiglu" and "mlp_up" in lora else 2  # (a LoRA's hook calls gate and up apart)
    rows = 2
    full = t.activation_checkpointing == "full"
    # (bytes, calls) of each collective's kind per micro-batch; column inputs and the residual stream travel in
    # the parameters' dtype, row outputs (a matmul's) in the compute dtype
    col_fwd, col_bwd = (cols * layers + (1 if last else 0), cols * layers + (1 if last else 0))  # (+ the head)
    row_fwd, row_bwd = rows * layers, rows * layers
    if full:
        col_fwd, row_fwd = col_fwd + cols * layers, row_fwd + rows * layers
    if sp:
        regather = col_bwd if cfg.peft.method == "none" else 0
        gather = ((col_fwd + regather) * compute + row_bwd * compute) * bsh * part
        scatter = (col_bwd * residual + row_fwd * compute) * bsh * part
        calls_g, calls_s = col_fwd + regather + row_bwd, col_bwd + row_fwd
        if first:  # the embedding: reduce-scatter forward, all-gather backward; learned positions gather (T, C)
            gather, scatter = gather + residual * bsh * part, scatter + residual * bsh * part
            calls_g, calls_s = calls_g + 1, calls_s + 1
            if m.pos_emb == "learned":
                gather += residual * m.block_size * m.n_embd * part
                calls_g += 1
        out.add("tp_all_gather", gather, calls_g, times=micro_steps)
        out.add("tp_reduce_scatter", scatter, calls_s, times=micro_steps)
    else:
        ops = (col_bwd * residual + row_fwd * compute + (residual if first else 0)) * bsh
        out.add("tp_all_reduce", 2 * part * ops, col_bwd + row_fwd + (1 if first else 0), times=micro_steps)
    if last:  # vocabulary-parallel cross-entropy: max, sum of exponentials, target logit per token
        out.add("tp_all_reduce", 3 * 2 * part * t.micro_batch_size * m.block_size * 4, 3, times=micro_steps)
    if sp:
        rows_bias = ("attn.proj.bias", "mlp.down.bias")
        shared = sum(math.prod(s) for n, s, g in params if g and (".ln_" in n or n.startswith("ln_f.")
                                                                  or n.endswith(rows_bias)))
        if shared:
            out.add("tp_all_reduce", 2 * part * shared * 4)
    out.add("all_reduce", 2 * part * 4)  # the gradient norm's tp-sharded part


