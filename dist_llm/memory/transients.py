"""Memory a rank needs beyond its model states and saved activations: the largest temporary buffer of a step
(the loss's logits, a gathered FSDP2 unit, ring attention's blocks, a recomputed block, the expert all-to-all),
what ZeRO-3 under a pipeline holds whole through a step, and the transients of building the model, loading
weights and exporting a checkpoint (the largest whole tensor each holds: issue 17's bound)."""

from __future__ import annotations

import math

from dist_llm.config import Config, ConfigError, reshard_after_forward, zero_draws_from_meta
from dist_llm.memory import moe as memory_moe
from dist_llm.memory.activations import _layer_bytes, _moe_layer_bytes, autocast_weight_copy_bytes
from dist_llm.memory.estimate import _runs_on_gloo
from dist_llm.memory.params import _block_params, _model_params, _rank_shape, _stage_layers, _stage_params


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


def temporary_bytes(cfg: Config, *, dp: int, tp: int, cp: int = 1, pp: int = 1, pp_rank: int = 0) -> int:
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
        world = dp * cp * tp * pp
        layer = _layer_bytes(cfg, tp=tp, dp=dp * cp, sequence_parallel=sp, world=world)
        if m.n_experts:
            layer = max(layer, _moe_layer_bytes(cfg, tp=tp, dp=dp * cp, sequence_parallel=sp, world=world))
        # autocast's 16-bit weight copies: the forward's cast cache holds every block's of the stage until the
        # forward ends (the weights are leaves that need a gradient); each recomputation in backward, an autocast
        # region of its own, makes its block's again (a block's share of the stage's here)
        stage = (autocast_weight_copy_bytes(cfg, tp=tp, pp=pp, pp_rank=pp_rank, dp=dp * cp, world=world)
                 - autocast_weight_copy_bytes(cfg, tp=tp, pp=pp, pp_rank=pp_rank, dp=dp * cp, world=world,
                                              head_only=True))
        blocks = max(1, len(_stage_layers(cfg, pp, pp_rank)) if pp > 1 else m.n_layer)
        candidates.append(round(layer * t.micro_batch_size * m.block_size // cp + stage / blocks))
        candidates.append(stage)
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


def zero_flat_build_bytes(cfg: Config, *, dp: int, pp: int) -> int:
    """Native ZeRO-1/2's build (parallel/data/zero.py) beyond the parameters it keeps. From a random start without
    PEFT it builds from the meta device (`_build_from_meta`): each trained parameter allocated whole in fp32 beside
    the flat buffer, drawn, cast into it (4 bytes of the largest; in fp32 drawn straight into the buffer: none).
    Otherwise it takes a materialised model: in mixed precision fp32 (4 bytes an element, where the 16-bit
    parameters count 2), each trained parameter cast to 16 bits on its own (its copy held beside it for a moment);
    in fp32 on an accelerator the flat buffer is allocated whole beside the parameters it then takes in (on the CPU
    its pages come as they are written: one parameter at a time). A form of its own over the experts under ep
    (built after the dense one): the larger of the two. The stage holding the most."""
    p = cfg.parallel
    if p.backend != "native" or p.zero_stage not in (1, 2) or dp * p.cp == 1:
        return 0
    tp, ep = p.tp, memory_moe.ep_degree(cfg)
    fp32 = cfg.train.precision == "fp32"
    from_meta = zero_draws_from_meta(cfg)
    if fp32 and (from_meta or _runs_on_gloo(cfg)):
        return 0
    worst = 0
    for stage in range(pp):
        parts = {False: [0, 0], True: [0, 0]}  # expert part or not -> [elements, largest]
        for name, shape, trains in _stage_params(cfg, pp, stage):
            if trains:
                n = math.prod(_rank_shape(name, shape, cfg, tp, ep))
                part = parts[ep > 1 and memory_moe.is_expert(name)]
                part[0], part[1] = part[0] + n, max(part[1], n)
        for n, largest in parts.values():
            worst = max(worst, 4 * largest if from_meta else 4 * n if fp32 else 2 * n + 2 * largest)
    return worst


def init_transient_bytes(cfg: Config, *, dp: int = 1, pp: int | None = None) -> int:
    """The build's transient beyond this rank's parameters, by the largest of what the build allocates whole:
      - in fp32, the largest piece model/init.py draws (`init_draw_numel`);
      - DeepSpeed's ZeRO-3 (`deepspeed_shards.build_partitioned`): each parameter of this rank's tp/ep part
        allocated whole in fp32, then its 16-bit copy for the engine (bf16/fp16) before the partitioner keeps a
        range: the largest parameter at 4 + 2 bytes an element (4 in fp32);
      - QLoRA (`qlora.materialise_quantised`, `qlora.quantise`, `_build_nf4`): each block linear allocated whole
        in fp32 and quantised to NF4 (`NF4Weight.quantize`'s working space: `_NF4_BYTES_PER_ELEMENT`, and the
        level search over at most nf4._SEARCH_CHUNK elements at once);
      - native ZeRO-1/2 at dp > 1 (`zero_flat_build_bytes`): from a random start one parameter in fp32 beside the
        flat buffer; from a materialised model the fp32 model it casts parameter by parameter, or in fp32 on an
        accelerator its flat buffer beside the parameters."""
    from dist_llm.parallel.data.deepspeed_shards import builds_partitioned
    from dist_llm.peft.nf4 import _SEARCH_CHUNK

    candidates = [4 * init_draw_numel(cfg), zero_flat_build_bytes(cfg, dp=dp, pp=pp or cfg.parallel.pp)]
    tp, ep = cfg.parallel.tp, memory_moe.ep_degree(cfg)
    qlora = cfg.peft.method == "qlora"
    for name, shape, _ in _model_params(cfg, peft=False):
        n = math.prod(_rank_shape(name, shape, cfg, tp, ep))
        if qlora and _block_linear(name):
            candidates.append((4 + _NF4_BYTES_PER_ELEMENT) * n + _NF4_SEARCH_BYTES * min(n, _SEARCH_CHUNK))
        elif builds_partitioned(cfg):
            candidates.append(n * (4 if cfg.train.precision == "fp32" else 4 + 2))
    return max(candidates)


def transient_bytes(cfg: Config, *, dp: int = 1, pp: int | None = None) -> tuple[int, int, int]:
    """(init, load, export) transients: what building the model allocates beyond a rank's shards
    (`init_transient_bytes`), and what holding the largest full tensor costs while loading weights and exporting
    a checkpoint. The bound a shard-by-shard implementation keeps to (issue 17); beyond a rank's own shards,
    which the model states count."""
    largest = largest_tensor_numel(cfg)
    return init_transient_bytes(cfg, dp=dp, pp=pp), largest * (_source_bytes(cfg) + 4), 8 * largest


def pipelined_zero3_bytes(cfg: Config, *, tp: int, pp: int, pp_rank: int) -> int:
    """What ZeRO-3 (FSDP2) under a pipeline holds whole through a step (parallel/data/fsdp.py): the stage's
    gradients accumulated unsharded in fp32 over its micro-batches (reduce-scattered once, in its last backward;
    none under parallel.pp_reduce_grads=micro_batch, which reduces after every backward), and unless
    parallel.reshard_after_forward=true its parameters, gathered in the compute dtype at its first forward and
    kept to its last backward. (A quantised base is counted at 4 bytes an element: an overestimate.)"""
    p, t = cfg.parallel, cfg.train
    if pp == 1 or p.zero_stage != 3 or p.backend != "native":
        return 0
    ep = memory_moe.ep_degree(cfg)
    local = [(math.prod(_rank_shape(n, s, cfg, tp, ep)), g) for n, s, g in _stage_params(cfg, pp, pp_rank)]
    grads = 0 if p.pp_reduce_grads == "micro_batch" else 4 * sum(n for n, g in local if g)
    size = 4 if t.precision == "fp32" else 2
    return grads + (0 if reshard_after_forward(cfg) else size * sum(n for n, _ in local))
