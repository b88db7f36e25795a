"""Context parallelism in the model: training at cp > 1 against one process, on gloo ranks.

Each cp rank holds the zigzag part (layout.py) of every sequence; attention is the ring (tests/test_ring_attention.py
checks it alone). The whole run must equal one process: losses to 1e-5 relative (fp32; the ring merges blocks by
log-sum-exp in another summation order than SDPA, and gradients are summed over dp x cp ranks instead of over one
batch, so results agree to rounding, not bit for bit), parameters to PARAM_ATOL (see test_data_parallel.py).
"""

from __future__ import annotations

import io
import json
import pickle
import shutil
from pathlib import Path
from typing import Any

import pytest

from dist_llm.config import ConfigError, load_config
from dist_llm.data.sampler import host_batch
from dist_llm.parallel.context_parallel import merge_sequence
from dist_llm.parallel.context_parallel.apply import sequence_positions
from tests.conftest import tiny_overrides
from tests.distributed import run_distributed
from tests.test_data_parallel import STEPS, assert_same_run, corpus, reference, train  # noqa: F401

BLOCK = 64  # 2 x cp = 8 chunks of 8 tokens at cp=4


def _ring_bytes(*, cp: int, dp: int = 1, n_kv_head: int = 4) -> int:
    """A training step's ring bytes on one rank (tiny_overrides: 2 layers, micro-batches of 4, global batch 8, head
    size 8, fp32): per layer and micro-batch, forward sends k and v (cp - 1) times, backward twice that."""
    block = 2 * 4 * n_kv_head * (BLOCK // cp) * 8 * 4  # (k, v) x (B, nkv, T/cp, hs) x fp32 bytes
    micro_batches = 8 // (4 * dp)
    return 3 * (cp - 1) * block * 2 * micro_batches


def _run(tmp_path: Path, corpus: Path, world: int, **extra: Any) -> dict[str, Any]:  # noqa: F811
    """Rank 0's report, with the parameters of every rank (pipeline stages hold different blocks)."""
    ranks = run_distributed(train, world, tmp_path, corpus, {"model__block_size": BLOCK, **extra}, init_group=False)
    for other in ranks[1:]:
        ranks[0]["params"] = {**other["params"], **ranks[0]["params"]}
    return ranks[0]


@pytest.mark.parametrize("pos_emb", ["rope", "learned", "alibi"])
def test_cp2_matches_one_process(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, corpus: Path,  # noqa: F811
                                 pos_emb: str) -> None:
    """Also: evaluation runs under cp as training does (its loss equal too); under ALiBi, selective activation
    checkpointing recomputes the ring attention core in backward (ring bytes: a third forward pass)."""
    model = {"model__block_size": BLOCK, "model__pos_emb": pos_emb}
    selective = pos_emb == "alibi"
    run_keys = {"train__activation_checkpointing": "selective"} if selective else {}
    got = _run(tmp_path / "cp2", corpus, 2, parallel__cp=2, train__eval_interval=4, **run_keys, **model)
    # (the ring ran: the run is not a cp=1 run in disguise)
    assert got["comm"]["ring"] == _ring_bytes(cp=2) * (4 if selective else 3) // 3
    ref = train(0, 1, tmp_path / "one", corpus, {"train__eval_interval": 4, **model})
    assert_same_run(got, ref, rtol=1e-5)
    val = {run: {r["step"]: r["val_loss"] for r in map(json.loads, (tmp_path / run / "metrics.jsonl").open())
                 if "val_loss" in r} for run in ("cp2", "one")}
    assert list(val["cp2"]) == list(val["one"]) == [4, 8]
    assert list(val["cp2"].values()) == pytest.approx(list(val["one"].values()), rel=1e-5)


def test_cp4_gqa_matches_one_process(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory,
                                     corpus: Path) -> None:  # noqa: F811
    model = {"model__block_size": BLOCK, "model__pos_emb": "rope", "model__n_kv_head": 2}
    got = _run(tmp_path, corpus, 4, parallel__cp=4, **model)
    assert got["comm"]["ring"] == _ring_bytes(cp=4, n_kv_head=2)  # (only the kv heads travel)
    assert_same_run(got, reference(tmp_path_factory, corpus, **model), rtol=1e-5)


@pytest.mark.parametrize("zero_stage", [0, 2])
def test_dp2_cp2_matches_one_process(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, corpus: Path,  # noqa: F811
                                     zero_stage: int) -> None:
    model = {"model__block_size": BLOCK, "model__pos_emb": "rope"}
    got = _run(tmp_path, corpus, 4, parallel__cp=2, parallel__zero_stage=zero_stage, **model)
    assert got["dp"] == ("ddp" if zero_stage == 0 else "zero2")
    assert got["comm"]["ring"] == _ring_bytes(cp=2, dp=2)
    assert_same_run(got, reference(tmp_path_factory, corpus, **model), rtol=1e-5)


@pytest.mark.parametrize("variant", ["tp2-sp", "pp2"])
def test_cp2_with_model_parallel_matches_one_process(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory,
                                                     corpus: Path, variant: str) -> None:  # noqa: F811
    """cp2 x tp2 with sequence parallelism (ALiBi: each tp rank's heads keep their own slopes), cp2 x pp2 (1F1B
    over activations of T/cp tokens)."""
    if variant == "tp2-sp":
        model = {"model__block_size": BLOCK, "model__pos_emb": "alibi", "model__n_kv_head": 2}
        layout = {"parallel__tp": 2, "parallel__sequence_parallel": True}
    else:
        model = {"model__block_size": BLOCK, "model__pos_emb": "rope"}
        layout = {"parallel__pp": 2}
    got = _run(tmp_path, corpus, 4, parallel__cp=2, **layout, **model)
    if variant == "tp2-sp":  # each tp rank passes its own kv head round its cp ring
        assert got["comm"]["ring"] == _ring_bytes(cp=2, n_kv_head=1)
    assert_same_run(got, reference(tmp_path_factory, corpus, **model), rtol=1e-5)


def test_checkpoint_from_cp2_resumes_at_cp1(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory,
                                            corpus: Path) -> None:  # noqa: F811
    model = {"model__block_size": BLOCK, "model__pos_emb": "rope"}
    first = tmp_path / "cp2"
    _run(first, corpus, 2, parallel__cp=2, train__stop_after_step=4, train__ckpt_interval=4, **model)
    out = tmp_path / "cp1"
    shutil.copytree(first, out)
    got = _run(out, corpus, 1, **model)
    ref = reference(tmp_path_factory, corpus, **model)
    assert len(got["losses"]) == STEPS  # the cp=2 run's 4 steps, then 4 resumed at cp=1
    for a, b in zip(got["losses"][4:], ref["losses"][4:], strict=True):
        assert a == pytest.approx(b, rel=1e-5)


def test_sampler_slices_are_the_zigzag_parts() -> None:
    """Every cp rank reads the same windows; merged back in rank order they are the whole window, targets too."""
    import numpy as np

    tokens = np.arange(1000, dtype=np.uint16) % 251
    mask = (np.arange(1000) % 7 != 0).astype(np.uint8)
    starts = np.array([3, 400, 17])
    x, y = host_batch(tokens, starts, BLOCK, mask)
    for cp in (2, 4):
        parts = [host_batch(tokens, starts, BLOCK, mask, positions=sequence_positions(r, cp, BLOCK)) for r in range(cp)]
        assert all(p[0].shape == (3, BLOCK // cp) for p in parts)
        assert merge_sequence([p[0] for p in parts], "zigzag").equal(x)
        assert merge_sequence([p[1] for p in parts], "zigzag").equal(y)


@pytest.mark.parametrize(("keys", "culprit"), [
    ({"model.block_size": 36}, "parallel.cp: model.block_size=36 is not divisible by 2*cp = 8"),
    ({"model.dropout": 0.1}, "parallel.cp: model.dropout=0.1 (attention dropout) is not supported with cp>1"),
    ({"model.n_experts": 4}, "parallel.cp: context parallelism with MoE (model.n_experts>0) is not yet supported"),
    ({"parallel.tp": 2, "parallel.sequence_parallel": True, "model.block_size": 72},
     "parallel.sequence_parallel: model.block_size=72 is not divisible by 2*cp*tp = 16"),
    ({"parallel.backend": "deepspeed"}, "parallel.cp: context parallelism with parallel.backend=deepspeed"),
])
def test_refusals_name_the_key(tmp_path: Path, keys: dict[str, Any], culprit: str) -> None:
    overrides = tiny_overrides(tmp_path, parallel__cp=4, model__block_size=BLOCK) + [f"{k}={v}" for k, v in keys.items()]
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert str(e.value).startswith(culprit) and "\n" not in str(e.value)


def test_memory_prediction_knows_cp(tmp_path: Path, corpus: Path) -> None:  # noqa: F811
    """`dist-llm memory` at cp=2: the states ZeRO-1 shards over dp x cp, activations of block_size/cp tokens; both
    equal what rank 0 measures (activations to the loss's 4-byte scalar, as test_memory.py; within 10% before the
    ring's own q, k, v and output were counted), and the measured activations fall to about half of one process's."""
    from dist_llm import memory
    from tests.test_memory import _config

    extra = {"train__max_steps": 1, "model__block_size": 128, "model__pos_emb": "rope", "parallel__zero_stage": 1}
    one = train(0, 1, tmp_path / "one", corpus, extra)
    got = _run(tmp_path / "cp2", corpus, 2, parallel__cp=2, **extra)
    est = memory.predict(_config(tmp_path, corpus, {**extra, "parallel__cp": 2}), 2, pp_rank=0)
    held = got["state_bytes"]
    assert (held["params"], held["grads"], held["master"], held["optimizer"]) == (
        est.params_bytes, est.grads_bytes, est.master_bytes, est.optimizer_bytes)
    assert 0 <= got["activation_bytes"] - est.activation_bytes <= 4, (got["activation_bytes"], est.activation_bytes)
    assert got["activation_bytes"] / one["activation_bytes"] == pytest.approx(0.5, rel=0.10)
    # the ring's buffers by hand (micro-batch 4, 4 heads of 8, 64 tokens a rank, fp32): k+v blocks held and
    # arriving 2 x 2*4*4*64*8*4 B, their gradient accumulators in flight both ways and home 3 x 16384*4 B, dq and
    # dO 2 x 4*4*64*8*4 B, one tile's scores, probabilities and their gradient 3 x 4*4*64*64*4 B
    ring = 2 * 16384 * 4 + 3 * 16384 * 4 + 2 * 8192 * 4 + 3 * 65536 * 4
    assert memory.ring_buffer_bytes(_config(tmp_path, corpus, extra), tp=1, cp=2) == ring == 1_179_648
    assert est.temporary_bytes >= ring  # (the largest of the transients)


def test_memory_of_the_long_config_defaults_to_its_cp_world() -> None:
    """`dist-llm memory --config configs/long.yaml` (cp=2) counts cp in the default world size (it said "WORLD_SIZE=1
    is not divisible by cp*tp*pp" before), and its activations are half of the same model's at cp=1 but for what
    ring attention keeps apart from SDPA: a contiguous v instead of the qkv output (kv = 128 values a token less,
    fp32) in each of 4 blocks, and once RoPE's cos and sin gathered at the rank's 4096 positions (32 fp32 each)."""
    from dist_llm import memory
    from dist_llm.config import load_config
    from tests.test_memory import cli

    out = cli("--config", "configs/long.yaml")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("long: world 2 (dp=1, cp=2, tp=1, pp=1)")
    long = Path(__file__).resolve().parents[1] / "configs" / "long.yaml"
    cp2, cp1 = memory.predict(load_config(long)), memory.predict(load_config(long, ["parallel.cp=1"]))
    ring = 4 * 4096 * -128 * 4 + 2 * 4096 * 32 * 4  # (8192 -> 4096 tokens a rank, one sequence a micro-batch)
    assert cp2.activation_bytes == cp1.activation_bytes / 2 + ring


def test_rope_tables_are_gathered_once_for_a_positions_tensor() -> None:
    """Context parallelism's positions are one tensor per length, asked for by every block: RoPE gathers its cos and
    sin at them once and hands every block the same pair (each block's rotation keeps it for backward, so one pair
    is alive rather than one a block); another positions tensor, cast or moved tables, or new tables gather again.
    The rotation equals the one from tables gathered anew."""
    import torch

    from dist_llm.model.positions import RotaryEmbedding

    rope = RotaryEmbedding(8, 16)
    pos = torch.tensor([0, 3, 5, 15])
    q, k = torch.randn(1, 2, 4, 8), torch.randn(1, 1, 4, 8)
    fresh = RotaryEmbedding(8, 16)
    first = rope(q, k, pos)
    cos = rope._gathered[1]
    second = rope(q, k, pos)
    assert rope._gathered[1] is cos  # (the same pair for the next block)
    reference = (fresh.cos[pos], fresh.sin[pos])
    assert torch.equal(cos, reference[0]) and torch.equal(rope._gathered[2], reference[1])
    for a, b in zip(first, second):
        assert torch.equal(a, b)
    rope(q, k, pos.clone())
    assert rope._gathered[1] is not cos  # (another positions tensor)
    rope(q, k, pos)
    before = rope._gathered[1]
    pos[3] = 7  # (an in-place write: gathered again)
    rope(q, k, pos)
    assert rope._gathered[1] is not before and torch.equal(rope._gathered[1], fresh.cos[pos])
    rope.cos.data = rope.cos.data * 2  # (a .data swap, as model/buffers.py casts buffers: gathered again)
    rope(q, k, pos)
    assert torch.equal(rope._gathered[1], 2 * fresh.cos[pos])
    rope.reset_parameters()
    rope.double()
    assert rope._gathered is None  # (a cast or a move lets the old pair go)
    out = rope(q.double(), k.double(), pos)
    assert rope._gathered[1].dtype == torch.float64 and out[0].dtype == torch.float64
    rope.reset_parameters()
    assert rope._gathered is None
    # a forward in inference mode keeps nothing: its tensors could not be saved by a training forward after it
    with torch.inference_mode():
        rope(q.double(), k.double(), pos)
    assert rope._gathered is None
    qd = q.double().requires_grad_()
    rope(qd, k.double(), pos)[0].sum().backward()
    assert qd.grad is not None
    with torch.inference_mode():  # (tables made in inference mode: no version counter, so never kept)
        built = RotaryEmbedding(8, 16)
    built(q, k, pos)
    assert built._gathered is None
    # a module holding a pair saves and pickles (its key's storages are not carried: the copy gathers its own)
    rope(q, k, pos)
    assert rope._gathered is not None
    buffer = io.BytesIO()
    torch.save(rope, buffer)
    buffer.seek(0)
    for copy in (torch.load(buffer, weights_only=False), pickle.loads(pickle.dumps(rope))):
        assert copy._gathered is None
        assert all(torch.equal(a, b) for a, b in zip(copy(q, k, pos), rope(q, k, pos), strict=True))
