"""QLoRA's base built one block linear at a time (peft/qlora.py): from a random start, a `ckpt:` start and an
`hf:` start, no two fp32 block weights exist at once, and the NF4 codes, scales and every other tensor equal
(bit for bit) those of quantising the whole fp32 one-process model, as the earlier build did."""

from __future__ import annotations

import re
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from dist_llm.config import Config, load_config
from dist_llm.model import GPT
from dist_llm.parallel.context import ParallelContext
from dist_llm.parallel.parallelize import meta_model, parallelize
from dist_llm.peft import apply_peft
from dist_llm.peft import qlora
from dist_llm.train.init_from import load_initial_weights, resolve_architecture
from tests.conftest import tiny_overrides
from tests.distributed import run_distributed
from tests.test_data_parallel import corpus, train  # noqa: F401
from tests.test_finetune import llama_dir  # noqa: F401
from tests.test_peft import ALL

QLORA = {"peft__method": "qlora", "peft__rank": 4, "peft__targets": ALL, "model__n_layer": 4, "model__bias": False}
TOKENS = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(3))


def _config(out_dir: Path, extra: dict[str, Any]) -> Config:
    return resolve_architecture(load_config(None, tiny_overrides(out_dir, **{**QLORA, **extra})))


def _fp32_block_weights(model: nn.Module, quantised: list[weakref.ref]) -> int:
    """How many fp32 block-linear weights exist now: those the model holds (allocated, not quantised yet)
    and those already quantised that something still keeps alive."""
    held = {id(m.weight) for m in model.blocks.modules()  # type: ignore[union-attr]
            if isinstance(m, nn.Linear) and m.weight is not None and not m.weight.is_meta}
    kept = {id(t) for ref in quantised if (t := ref()) is not None}
    return len(held | kept)


def _build(rank: int, world_size: int, out_dir: Path, extra: dict[str, Any]) -> dict[str, Any]:
    """This rank's state after the build (full tensors), and the most fp32 block weights alive at a quantisation."""
    cfg = _config(out_dir, extra)
    ctx = ParallelContext.from_config(cfg)
    try:
        model = meta_model(cfg, ctx)
        alive: list[int] = []
        quantised: list[weakref.ref] = []
        real = qlora.quantise

        def counting(whole: nn.Module, module_name: str, linear: nn.Linear) -> None:
            alive.append(_fp32_block_weights(model, quantised))
            quantised.append(weakref.ref(linear.weight))
            real(whole, module_name, linear)

        with pytest.MonkeyPatch.context() as patch:  # (every build quantises through qlora.quantise)
            patch.setattr(qlora, "quantise", counting)
            built = parallelize(model, cfg, ctx, load=load_initial_weights).dp.module
        state = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).detach().clone()
                 for k, v in built.state_dict().items()}
        out: dict[str, Any] = {"state": state, "most_alive": max(alive), "quantised": len(alive)}
        if ctx.world_size == 1:
            with torch.no_grad():
                out["loss"] = built(TOKENS[:, :-1], TOKENS[:, 1:])
        return out
    finally:
        ctx.destroy()


def _reference(cfg: Config, base: GPT | None = None) -> GPT:
    """The earlier build: the whole fp32 one-process model (drawn from train.seed, or `base`), then quantised."""
    if base is None:
        base = GPT(cfg.model)
        base.reset_parameters(cfg.train.seed)
    apply_peft(base, cfg.peft, seed=cfg.train.seed)
    return base


def _assert_same(got: dict[str, torch.Tensor], ref: GPT, what: str) -> None:
    want = ref.state_dict()
    assert sorted(got) == sorted(want), what
    assert not any(isinstance(m, nn.Linear) for m in ref.blocks.modules()), what  # every block linear in NF4
    for name, t in want.items():
        assert torch.equal(got[name], t), f"{what}: {name}"


def _merged(ranks: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    merged: dict[str, torch.Tensor] = {}
    for r in ranks:  # pipeline stages each hold their own blocks; ZeRO-3 ranks hold everything
        for name, t in r["state"].items():
            assert torch.equal(t, merged.setdefault(name, t)), f"{name} differs between ranks"
    return merged


def test_a_random_start_quantises_one_layer_at_a_time_to_the_same_nf4(tmp_path: Path) -> None:
    """Before, a random start drew the whole fp32 base and apply_peft then quantised it: all 16 block weights
    existed at the first quantisation. Now each is drawn (from its own generator, as one process draws it),
    quantised and freed before the next: the same codes, scales and loss, bit for bit."""
    one = _build(0, 1, tmp_path / "one", {})
    ref = _reference(_config(tmp_path / "ref", {}))
    assert one["quantised"] == 16 and one["most_alive"] == 1
    _assert_same(one["state"], ref, "one process")
    with torch.no_grad():
        assert torch.equal(one["loss"], ref(TOKENS[:, :-1], TOKENS[:, 1:]))


@pytest.mark.parametrize("layout", ["pp2", "zero3-dp2"])
def test_a_random_start_at_other_layouts_equals_one_process(tmp_path: Path, layout: str) -> None:
    extra = {"pp2": {"parallel__pp": 2}, "zero3-dp2": {"parallel__dp": 2, "parallel__zero_stage": 3}}[layout]
    ranks = run_distributed(_build, 2, tmp_path / "many", extra, init_group=False, timeout=120)
    assert all(r["most_alive"] == 1 for r in ranks)
    _assert_same(_merged(ranks), _reference(_config(tmp_path / "ref", {})), layout)


@pytest.fixture(scope="module")
def base_step(tmp_path_factory: pytest.TempPathFactory, corpus: Path) -> Path:  # noqa: F811
    """A dist_llm checkpoint of the QLORA model (trained 2 steps, so that it differs from the random start)."""
    out = tmp_path_factory.mktemp("base")
    train(0, 1, out, corpus, {"train__max_steps": 2, "train__ckpt_interval": 2, "model__n_layer": 4})
    return out / "checkpoints" / "step_000002"


def test_a_checkpoint_start_reads_and_quantises_one_layer_at_a_time(tmp_path: Path, base_step: Path) -> None:
    """`ckpt:`: DCP reads everything but the block linears at once, then each block linear alone, quantised
    before the next is read (before, the whole fp32 base was loaded, then quantised)."""
    from dist_llm.sample import load_model

    extra = {"model__init_from": f"ckpt:{base_step}"}
    one = _build(0, 1, tmp_path / "one", extra)
    assert one["quantised"] == 16 and one["most_alive"] == 1
    base, _ = load_model(base_step, torch.device("cpu"))
    ref = _reference(_config(tmp_path / "ref", extra), base)
    _assert_same(one["state"], ref, "one process")
    with torch.no_grad():
        assert torch.equal(one["loss"], ref(TOKENS[:, :-1], TOKENS[:, 1:]))
    ranks = run_distributed(_build, 2, tmp_path / "pp2", {**extra, "parallel__pp": 2}, init_group=False, timeout=120)
    assert all(r["most_alive"] == 1 for r in ranks)
    _assert_same(_merged(ranks), ref, "pp2")


def test_an_hf_start_still_quantises_one_layer_at_a_time(tmp_path: Path, llama_dir: Path) -> None:  # noqa: F811
    from dist_llm.hf import load_hf

    extra = {"model__init_from": f"hf:{llama_dir}"}
    one = _build(0, 1, tmp_path / "one", extra)
    assert one["most_alive"] == 1
    cfg = _config(tmp_path / "ref", extra)
    _assert_same(one["state"], _reference(cfg, load_hf(llama_dir, cfg.model)), "hf")


def _build_failing_on_rank_1(rank: int, world_size: int, out_dir: Path, extra: dict[str, Any]) -> str | None:
    """The build, with rank 1's reads of its block linears failing (as a damaged chunk would)."""
    from dist_llm.config import ConfigError
    from dist_llm.train import init_from
    from dist_llm.train.errors import ReadError

    def damaged(reader: Any, where: Path, name: str, out: torch.Tensor) -> None:
        raise OSError(f"{where}: a damaged chunk of {name}")

    with pytest.MonkeyPatch.context() as patch:
        if rank == 1:
            patch.setattr(init_from, "_read_alone", damaged)
        try:
            _build(rank, world_size, out_dir, extra)
        except (ConfigError, ReadError) as e:  # (an OSError is the system's failure to read: ReadError, exit 1)
            return f"{type(e).__name__}: {e}"
    return None


def test_a_block_linear_read_failing_on_one_rank_fails_every_rank(tmp_path: Path, base_step: Path) -> None:
    """The block linears are read by each rank alone (the stages hold different ones): a failure there reaches
    the other rank as the same one line, instead of leaving it in its next collective alone."""
    extra = {"model__init_from": f"ckpt:{base_step}", "parallel__pp": 2}
    errors = run_distributed(_build_failing_on_rank_1, 2, tmp_path, extra, init_group=False, timeout=120)
    assert errors[0] is not None and errors[0] == errors[1], errors
    assert re.fullmatch(rf"ReadError: rank 1: model.init_from: OSError: {re.escape(str(base_step))}: a damaged chunk of "
                        r"blocks\.\d+\.attn\.qkv\.weight", errors[0]), errors[0]


def test_a_checkpoint_start_reads_its_index_once(tmp_path: Path, base_step: Path) -> None:
    """The DCP index of a `ckpt:` start is parsed once for the whole build: the checks, the load of everything
    else and the 16 block linears' reads share one reader (before, each of them opened its own, 18 parses)."""
    from dist_llm.train import checkpoint as ckpt

    parses: list[Path] = []
    real = ckpt.load_index

    def counting(file: Any, path: Path) -> Any:
        parses.append(path)
        return real(file, path)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ckpt, "load_index", counting)
        one = _build(0, 1, tmp_path / "one", {"model__init_from": f"ckpt:{base_step}"})
    assert one["quantised"] == 16
    assert parses == [base_step / ".metadata"], parses
