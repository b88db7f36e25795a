"""Data parallelism (DDP, ZeRO-1/2 written here, ZeRO-3 on FSDP2) against one process, on gloo ranks."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from dist_llm.config import load_config
from dist_llm.parallel.context import ParallelContext
from dist_llm.train.trainer import Trainer
from tests.conftest import tiny_overrides
from tests.distributed import run_distributed

STEPS = 8


def _full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().float().clone()


def train(rank: int, world_size: int, out_dir: Path, corpus: Path, extra: dict[str, Any]) -> dict[str, Any]:
    """Train in this process (a rank, or the test process itself for the reference) and report.

    No biases: the key bias has an exactly-zero true gradient (softmax ignores a constant added to a row of
    scores), so Adam turns its float-rounding noise into steps of size lr and that parameter would differ
    between any two summation orders, parallel or not."""
    cfg = load_config(None, tiny_overrides(out_dir, **{"data__source": str(corpus), "train__max_steps": STEPS,
                                                       "train__eval_interval": 0, "model__bias": False, **extra}))
    ctx = ParallelContext.from_config(cfg)
    try:
        trainer = Trainer(cfg, ctx)
        trainer.fit()
        params = {n: _full(p) for n, p in trainer.module.named_parameters()}
        if trainer.tp_state is not None:  # tensor-parallel slices -> the full tensors
            params = trainer.tp_state.to_full({"model": params, "optim": {"state": {}}})["model"]
        out = {"params": params, "state_bytes": trainer.state_bytes, "comm": trainer.comm_bytes,
               "n_params": trainer.module.num_params(), "dp": trainer.dp.name,
               "activation_bytes": trainer.activation_bytes, "pp_rank": ctx.pp_rank}
        if rank == 0:
            lines = [json.loads(x) for x in (out_dir / "metrics.jsonl").read_text().splitlines()]
            out["losses"] = [r["loss"] for r in lines if "loss" in r]
            out["records"] = [r for r in lines if "loss" in r]
            out["val_losses"] = [r["val_loss"] for r in lines if "val_loss" in r]
        return out
    finally:
        ctx.destroy()


_REFERENCE: dict[str, dict[str, Any]] = {}


def reference(tmp_path_factory: pytest.TempPathFactory, corpus: Path, **extra: Any) -> dict[str, Any]:
    key = json.dumps({**extra, "corpus": str(corpus)}, sort_keys=True)
    if key not in _REFERENCE:
        _REFERENCE[key] = train(0, 1, tmp_path_factory.mktemp("ref"), corpus, extra)
    return _REFERENCE[key]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    import sysconfig

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_text("\n".join((stdlib / n).read_text() for n in ["argparse.py", "functools.py", "textwrap.py"]))
    return path


# Parameters after 8 steps are compared to an absolute 3e-5 (1% of one Adam step at lr 3e-3): rows of the
# embedding for bytes the corpus never contains get gradients of ~1e-9 from the softmax alone, whose rounding
# differs once a reduction sums in another order (ranks, vocabulary shards, and the CPU's own matmul kernels),
# and Adam scales such noise up towards a step of size lr. The losses are compared at 1e-5 relative.
PARAM_ATOL = 3e-5


def assert_same_run(got: dict[str, Any], ref: dict[str, Any], *, rtol: float, param_atol: float = PARAM_ATOL) -> None:
    assert len(got["losses"]) == STEPS
    for a, b in zip(got["losses"], ref["losses"], strict=True):
        assert a == pytest.approx(b, rel=rtol)
    for name, p in ref["params"].items():
        torch.testing.assert_close(got["params"][name], p, rtol=rtol, atol=param_atol,
                                   msg=lambda m, name=name: f"{name}: {m}")


@pytest.mark.parametrize("zero_stage", [0, 1, 2, 3])
@pytest.mark.parametrize("dp", [2, 4])
def test_matches_single_process(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, corpus: Path,
                                dp: int, zero_stage: int) -> None:
    # global batch 8: micro 4 gives accumulation 1 at dp=2; micro 2 at dp=4
    extra = {"parallel__zero_stage": zero_stage, "train__micro_batch_size": 8 // dp,
             "parallel__bucket_mb": 0.01}  # several buckets, so ZeRO-2 overlaps and ZeRO's bucket logic is exercised
    results = run_distributed(train, dp, tmp_path, corpus, extra, init_group=False)
    ref = reference(tmp_path_factory, corpus)
    assert_same_run(results[0], ref, rtol=1e-5)
    for r in results[1:]:  # every rank ends with the same full model
        for name, p in results[0]["params"].items():
            torch.testing.assert_close(r["params"][name], p, rtol=0, atol=0)


@pytest.mark.parametrize("zero_stage", [0, 1, 2, 3])
def test_gradient_accumulation(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, corpus: Path,
                               zero_stage: int) -> None:
    extra = {"parallel__zero_stage": zero_stage, "train__micro_batch_size": 2}  # dp=2: 2 micro-steps
    results = run_distributed(train, 2, tmp_path, corpus, extra, init_group=False)
    assert_same_run(results[0], reference(tmp_path_factory, corpus), rtol=1e-5)


def expected_state_bytes(n: int, dp: int, stage: int, precision: str) -> dict[str, float]:
    """Per-rank model-state bytes (ZeRO paper, Rajbhandari et al. 2020, with K=12 for mixed precision).

    Mixed precision keeps 16-bit parameters and 12 bytes of fp32 master + Adam per parameter (the paper's
    2+2+12), but gradients accumulate in fp32 (parallel.grad_accum_dtype's default): 4 bytes. Stage 0 (DDP)
    and stage 3 (FSDP2) autocast over fp32 parameters, which are their own master copy: 4+4+8. fp32 runs
    have no separate master. (ZeRO-2's two bucket buffers, a few KiB here, fall within the test's padding.)"""
    p16 = 2 if precision != "fp32" and stage in (1, 2) else 4
    master = 4 if p16 == 2 else 0
    shard = {0: (1, 1, 1), 1: (1, 1, dp), 2: (1, dp, dp), 3: (dp, dp, dp)}[stage]  # params, grads, optimizer
    return {"params": p16 * n / shard[0], "grads": 4 * n / shard[1], "master": master * n / shard[2],
            "optimizer": 8 * n / shard[2]}


def expected_comm_bytes(n: int, dp: int, stage: int, precision: str) -> float:
    """Per-rank bytes sent per step: a ring all-reduce of the gradients moves 2(dp-1)/dp of them; ZeRO-1/2 the
    same as reduce-scatter + all-gather; ZeRO-3 gathers parameters twice (forward and backward) and
    reduce-scatters gradients, 3(dp-1)/dp: 1.5x. In bf16, ZeRO-1 reduces its fp32 accumulator and gathers
    16-bit parameters, ZeRO-2 reduces each micro-step's 16-bit gradients and gathers 16-bit parameters,
    ZeRO-3 gathers 16-bit parameters and reduces fp32 gradients, DDP reduces fp32 gradients."""
    mixed = precision != "fp32"
    p16 = 2 if mixed else 4
    per_param = {0: 2 * 4, 1: 4 + p16, 2: 2 * p16, 3: 2 * p16 + 4}[stage]
    return (dp - 1) / dp * per_param * n


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("zero_stage", [0, 1, 2, 3])
def test_state_and_comm_bytes(tmp_path: Path, corpus: Path, zero_stage: int, precision: str) -> None:
    dp = 2
    extra = {"parallel__zero_stage": zero_stage, "train__precision": precision}
    result = run_distributed(train, dp, tmp_path, corpus, extra, init_group=False)[0]
    n = result["n_params"]
    for kind, want in expected_state_bytes(n, dp, zero_stage, precision).items():
        got = result["state_bytes"][kind]
        # padding (ZeRO buckets to a multiple of dp, FSDP2 rows) and Adam's step counters (4 bytes each)
        assert want <= got <= want * 1.01 + 512, (kind, got, want)
    sent = sum(result["comm"].values())
    want = expected_comm_bytes(n, dp, zero_stage, precision)
    assert abs(sent - want) <= 0.10 * want, (result["comm"], want)
    if zero_stage == 3:  # no gradient all-reduce: only the two floats of the global norm
        assert set(result["comm"]) == {"all_gather", "reduce_scatter", "all_reduce"}
        assert result["comm"]["all_reduce"] == 8


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("zero_stage", [0, 1, 2, 3])
def test_mixed_precision_close_to_single_process(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory,
                                                 corpus: Path, zero_stage: int, precision: str) -> None:
    """bf16, and fp16 with dynamic loss scaling, on every stage: within 1e-2 of one process.

    fp16 starts at a scale of 2^10: at 2^16 a rank's backward (over half the batch, so twice the gradient per
    sample) overflows where the one-process run does not, and the skipped step, correct in itself, makes
    the runs differ by design."""
    scale = {"train__loss_scale_init": 1024.0} if precision == "fp16" else {}
    extra = {"parallel__zero_stage": zero_stage, "train__precision": precision, **scale}
    got = run_distributed(train, 2, tmp_path, corpus, extra, init_group=False)[0]
    ref = reference(tmp_path_factory, corpus, train__precision=precision, **scale)
    for a, b in zip(got["losses"], ref["losses"], strict=True):
        assert a == pytest.approx(b, abs=1e-2)


@pytest.mark.parametrize("extra", [{"parallel__offload": "cpu"}, {"parallel__reshard_after_forward": False}],
                         ids=["offload", "no-reshard"])
def test_zero3_options(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory, corpus: Path,
                       extra: dict[str, Any]) -> None:
    got = run_distributed(train, 2, tmp_path, corpus, {"parallel__zero_stage": 3, **extra}, init_group=False)[0]
    assert_same_run(got, reference(tmp_path_factory, corpus), rtol=1e-5)
    if extra.get("parallel__reshard_after_forward") is False:  # parameters gathered once: the all-reduce's bytes
        assert sum(got["comm"].values()) == pytest.approx(expected_comm_bytes(got["n_params"], 2, 0, "fp32"),
                                                          rel=0.10)


def test_checkpoint_reshards_across_layouts(tmp_path: Path, tmp_path_factory: pytest.TempPathFactory,
                                            corpus: Path) -> None:
    """Saved at dp=2 ZeRO-2, resumed at dp=1 and at dp=4 ZeRO-3: the next losses are the uninterrupted run's."""
    import shutil

    first = tmp_path / "first"
    run_distributed(train, 2, first, corpus, {"parallel__zero_stage": 2, "train__stop_after_step": 4,
                                              "train__ckpt_interval": 4}, init_group=False)
    ref = reference(tmp_path_factory, corpus)
    for dp, stage in [(1, 0), (4, 3)]:
        out = tmp_path / f"dp{dp}"
        shutil.copytree(first, out)
        extra = {"parallel__zero_stage": stage, "train__micro_batch_size": 8 // dp}
        got = run_distributed(train, dp, out, corpus, extra, init_group=False)[0]
        assert len(got["losses"]) == STEPS  # the metrics file holds steps 1-4, then 5-8 after the resume
        for a, b in zip(got["losses"][4:], ref["losses"][4:], strict=True):
            assert a == pytest.approx(b, rel=1e-5)


# -- ZeRO-1/2 gradient accumulation dtype (parallel.grad_accum_dtype) -------------------------------------------
MICRO_STEPS = 16


def _accum_config(out_dir: Path, stage: int, accum: str):  # type: ignore[no-untyped-def]
    return load_config(None, tiny_overrides(out_dir, **{"train__precision": "bf16", "parallel__zero_stage": stage,
                                                        "parallel__grad_accum_dtype": accum, "model__bias": False,
                                                        "parallel__bucket_mb": 0.01}))


def _micro_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(7)
    tokens = torch.randint(0, 256, (MICRO_STEPS, 1, 33), generator=g)
    return [(t[:, :-1], t[:, 1:]) for t in tokens]


def zero_accumulated_grads(rank: int, world_size: int, out_dir: Path, stage: int) -> dict[str, dict[str, Any]]:
    """Every rank sees the same 16 micro-batches, so the mean over dp of its 16-bit micro-gradient g is g itself
    (g/2 + g/2 is exact): what ZeRO ends with is the accumulation of exactly the micro-gradients one bf16
    process computes. Returns, per accumulation dtype, each parameter's (offset, gradient piece) on this rank."""
    from dist_llm.model import GPT
    from dist_llm.parallel.data.zero import ZeroDataParallel
    from dist_llm.precision import autocast

    out = {}
    ctx = None
    try:
        for accum in ("fp32", "bf16"):
            cfg = _accum_config(out_dir, stage, accum)
            # one process group for both runs (the second call finds it): tearing it down and starting another
            # on the same port races with the old store under load
            ctx = ParallelContext.from_config(cfg)
            torch.manual_seed(0)
            model = GPT(cfg.model)
            dp = ZeroDataParallel(model, cfg, ctx, stage=stage)
            for i, (x, y) in enumerate(_micro_batches()):
                with dp.micro_step(last=i == MICRO_STEPS - 1), autocast("bf16", ctx.device):
                    dp.backward(model(x, y))
            dp.finish_grads()
            names = {id(p): n for n, p in model.named_parameters()}
            out[accum] = {names[id(p)]: (offset, g.detach().clone()) for p, g, offset in dp.grad_shards()}
    finally:
        if ctx is not None:
            ctx.destroy()
    return out


def _gather_pieces(ranks: list[dict[str, tuple[int, torch.Tensor]]], shapes: dict[str, torch.Size]) -> dict[str, torch.Tensor]:
    full = {n: torch.full((s.numel(),), float("nan")) for n, s in shapes.items()}
    for pieces in ranks:
        for name, (offset, g) in pieces.items():
            full[name][offset : offset + g.numel()] = g.float().reshape(-1)
    return {n: t.view(shapes[n]) for n, t in full.items()}


@pytest.mark.parametrize("stage", [1, 2])
def test_zero_accumulates_bf16_micro_gradients_in_fp32(tmp_path: Path, stage: int) -> None:
    """bf16, 16 micro-steps: ZeRO's gradient is the fp32 sum of the bf16 micro-gradients up to fp32 rounding, which
    bf16 accumulation (the former behaviour, now parallel.grad_accum_dtype=bf16) is not."""
    from dist_llm.model import GPT

    results = run_distributed(zero_accumulated_grads, 2, tmp_path, stage, init_group=False)
    # the same micro-gradients, computed here by plain autograd on a bf16 copy of the model (one thread, as the
    # ranks run, so that the CPU kernels sum in the same order)
    cfg = _accum_config(tmp_path, stage, "fp32")
    torch.manual_seed(0)
    model = GPT(cfg.model).to(torch.bfloat16)
    params = dict(model.named_parameters())
    fp32_sum = {n: torch.zeros(p.shape) for n, p in params.items()}
    abs_sum = {n: torch.zeros(p.shape) for n, p in params.items()}
    bf16_sum = {n: torch.zeros(p.shape, dtype=torch.bfloat16) for n, p in params.items()}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for x, y in _micro_batches():
            with torch.autocast("cpu", dtype=torch.bfloat16):
                grads = torch.autograd.grad(model(x, y), list(params.values()))
            for n, g in zip(params, grads, strict=True):
                fp32_sum[n] += g.float()
                abs_sum[n] += g.float().abs()
                bf16_sum[n] += g
    finally:
        torch.set_num_threads(threads)
    shapes = {n: p.shape for n, p in params.items()}
    for accum in ("fp32", "bf16"):
        got = _gather_pieces([r[accum] for r in results], shapes)
        for n in params:
            # recursive summation of k terms errs by at most (k-1) u sum|g_i|, u = 2^-24 in fp32 (Higham, Thm 4.1)
            bound = (MICRO_STEPS - 1) * 2.0**-24 * abs_sum[n]
            err = (got[n] - fp32_sum[n]).abs()
            if accum == "fp32":
                assert (err <= bound).all(), f"{n}: fp32 accumulation off by {(err - bound).max():.3g} beyond rounding"
            else:  # bf16 accumulation is the bf16 running sum, far outside fp32 rounding
                torch.testing.assert_close(got[n], bf16_sum[n].float(), rtol=0, atol=0)
        if accum == "bf16":
            worst = max(((got[n] - fp32_sum[n]).abs() / ((MICRO_STEPS - 1) * 2.0**-24 * abs_sum[n] + 1e-30)).max()
                        for n in params)
            assert worst > 1000, worst


# -- parallel.offload=cpu: every tensor on its own device ----------------------------------------------------------
def test_offload_device_logic_with_a_stand_in_accelerator() -> None:
    """Offloaded gradients and optimizer shards live on the CPU while the loss scale, the norm's collectives and
    the skip flag live on the accelerator: unscale, clip (with tp-replicated rows and a tp-sharded parameter) and
    the guarded step, run with the meta device standing in for the accelerator (tests/standin_device.py), mix no
    devices and give the values computed here by hand."""
    from types import SimpleNamespace

    from torch import nn

    from dist_llm.parallel.data.base import DataParallel
    from dist_llm.optim import guarded_step
    from dist_llm.precision import LossScaler
    from tests.standin_device import STANDIN, standin, value

    class Offloaded(DataParallel):
        dp_sharded_grads = True

        def __init__(self, ctx: Any, shards: list[tuple[nn.Parameter, torch.Tensor, int]]) -> None:
            self.ctx, self.shards = ctx, shards

        def grad_shards(self) -> list[tuple[nn.Parameter, torch.Tensor, int]]:
            return self.shards

    torch.manual_seed(0)
    w, v = nn.Parameter(torch.randn(6, 4)), nn.Parameter(torch.randn(5))
    w.tp_replicated_rows = (2, 4, 2)  # type: ignore[attr-defined]  # rows 2-3 held alike by 2 tp ranks
    v.tp_partition_dim = 0  # type: ignore[attr-defined]
    gw, gv = torch.randn(6, 4), torch.randn(5)
    # by hand: replicated rows count half on each of the 2 tp ranks (here the one rank of a 1-rank group)
    norm = (gw.pow(2).sum() - 0.5 * gw[2:4].pow(2).sum() + gv.pow(2).sum()).sqrt()
    coef = 0.5 / (norm + 1e-6)
    ref_w, ref_v = nn.Parameter(w.detach().clone()), nn.Parameter(v.detach().clone())
    ref_w.grad, ref_v.grad = gw * coef, gv * coef
    ref = torch.optim.AdamW([ref_w, ref_v], lr=0.1, fused=True)
    ref.step()

    ctx = SimpleNamespace(device=STANDIN, dp_group=None, dp_cp_group=None, pp_group=None, tp_group=None, comm=None,
                          ep=1, ep_group=None)
    with standin():
        scaler = LossScaler(enabled=True, scale=1024.0, device=STANDIN)
        w.grad, v.grad = gw * 1024, gv * 1024  # scaled gradients, offloaded
        dp = Offloaded(ctx, [(w, w.grad, 0), (v, v.grad, 0)])
        scaler.unscale_([w.grad, v.grad])
        got_norm = dp.clip_grad_norm_(0.5)
        assert got_norm.device == STANDIN and w.grad.device.type == "cpu"
        found_inf = (~torch.isfinite(got_norm)).float()
        scaler.update(found_inf)
        opt = torch.optim.AdamW([w, v], lr=0.1, fused=True)
        guarded_step(opt, found_inf)
        before = w.detach().clone()
        guarded_step(opt, torch.ones((), device=STANDIN))  # a skipped step leaves the shards as they were
    # powers of two (the scale) are exact; the norm's sums differ from the hand order by fp32 rounding only
    torch.testing.assert_close(value(got_norm), norm, rtol=1e-6, atol=0)
    torch.testing.assert_close(w.grad, gw * coef, rtol=1e-6, atol=0)
    torch.testing.assert_close(w.detach(), ref_w.detach(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(v.detach(), ref_v.detach(), rtol=1e-6, atol=1e-7)
    assert torch.equal(w.detach(), before)


@pytest.mark.parametrize("extra", [
    {"train__precision": "fp32", "parallel__zero_stage": 2},  # no 16-bit gradients to keep in 16 bits
    {"train__precision": "fp16", "parallel__zero_stage": 2},  # another 16-bit dtype than the run's
    {"train__precision": "bf16", "parallel__zero_stage": 3},  # FSDP2 accumulates in its own fp32 shards
    {"train__precision": "bf16", "parallel__zero_stage": 1, "parallel__backend": "deepspeed"},
], ids=["fp32-run", "other-dtype", "fsdp2", "deepspeed"])
def test_grad_accum_dtype_16_bit_only_where_it_exists(tmp_path: Path, extra: dict[str, Any]) -> None:
    from dist_llm.config import ConfigError

    with pytest.raises(ConfigError) as e:
        load_config(None, tiny_overrides(tmp_path, parallel__grad_accum_dtype="bf16", **extra))
    assert str(e.value).startswith("parallel.grad_accum_dtype=bf16 needs train.precision=bf16 with "
                                   "parallel.zero_stage 1 or 2 and parallel.backend=native")
    assert "\n" not in str(e.value)
    load_config(None, tiny_overrides(tmp_path, parallel__grad_accum_dtype="bf16", train__precision="bf16",
                                     parallel__zero_stage=1))  # the one combination it is for


def zero_build_peak(rank: int, world_size: int, out_dir: Path, stage: int, precision: str) -> dict[str, int]:
    """Bytes the CPU allocator holds at its highest while the model is built and ZeRO wraps it (the profiler's
    allocation events: the model's own parameters are allocated inside the window, so their release counts)."""
    from torch.profiler import ProfilerActivity, profile

    from dist_llm.model import GPT
    from dist_llm.parallel.data.zero import ZeroDataParallel

    cfg = load_config(None, tiny_overrides(out_dir, **{"train__precision": precision, "parallel__zero_stage": stage,
                                                       "model__n_embd": 128, "model__n_layer": 2}))
    ctx = ParallelContext.from_config(cfg)
    try:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            model = GPT(cfg.model)
            sizes = [p.numel() * p.element_size() for p in model.parameters()]
            dp = ZeroDataParallel(model, cfg, ctx, stage=stage)
        events = sorted((e for e in prof.events() if e.self_cpu_memory_usage), key=lambda e: e.time_range.start)
        live = peak = 0
        for e in events:
            live += e.self_cpu_memory_usage
            peak = max(peak, live)
        grads = dp.flat_grads if dp.flat_grads is not None else dp.grad_shard
        assert grads is not None
        return {"peak": peak, "params": sum(sizes), "largest": max(sizes), "grads": grads.numel() * grads.element_size(),
                "flat": dp.flat_params.numel() * dp.flat_params.element_size(),
                "master": 0 if dp.master is None else dp.master.numel() * 4}
    finally:
        ctx.destroy()


@pytest.mark.parametrize("stage,precision", [(1, "fp32"), (2, "bf16")])
def test_zero_build_holds_no_full_fp32_copy(tmp_path: Path, stage: int, precision: str) -> None:
    """Wrapping copies each parameter into the flat buffer and releases it at once, and takes the fp32 masters
    of this rank's shard straight from it. So the build holds at most, at its highest, either the fp32
    parameters with the flat buffer and the master shard (while copying) or those two with the gradient buffer
    (after), plus the largest single tensor for what GPT's init draws. The former build also made a whole fp32
    copy of every parameter (master_full) while the parameters and the flat buffer were alive: one more full
    fp32 model, more than the largest tensor (a quarter of it here) can hide."""
    for r in run_distributed(zero_build_peak, 2, tmp_path, stage, precision, init_group=False):
        bound = max(r["params"], r["grads"]) + r["flat"] + r["master"] + r["largest"]
        assert r["peak"] <= bound, f"build peak {r['peak']} B above {bound} B: {r}"
