"""`model.init_from=hf:`: each rank reads only the regions of the Hugging Face tensors it keeps.

The reads from safetensors files are counted (elements, dtypes, files opened) and compared with each rank's share
computed from the shapes alone; the loaded slices give the logits of transformers' model (or equal the whole
checkpoint's tensors) at tp=2, on a pipeline stage, under FSDP2, and built on the meta device."""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import dist_llm.hf as hf_module
from dist_llm.config import Config, ConfigError, ModelConfig, load_config
from dist_llm.hf import HFCheckpoint, load_hf, load_hf_state_dict, read_hf_tensors
from dist_llm.model import GPT
from dist_llm.parallel.context import ParallelContext
from dist_llm.safetensors_read import ShardFile
from dist_llm.train.init_from import load_initial_weights, resolve_architecture
from tests.conftest import tiny_overrides
from tests.distributed import run_distributed
from tests.test_hf import VOCAB, hf_gpt2, hf_llama, hf_logits, save


# -- counting safetensors' reads -----------------------------------------------------------------------------
class ReadLog:
    def __init__(self) -> None:
        self.elements = 0
        self.by_key: Counter[str] = Counter()
        self.dtypes: set[torch.dtype] = set()
        self.files: set[str] = set()


def count_reads() -> ReadLog:
    """Count what dist_llm.hf reads from safetensors files (the kept part of each block: elements, dtypes, files
    read); returns the log (in this process)."""
    log = ReadLog()
    real = getattr(ShardFile.blocks, "real", ShardFile.blocks)

    def blocks(self: ShardFile, key: str, *args: Any, **kwargs: Any) -> Iterator[tuple[int, torch.Tensor]]:
        log.files.add(self.file.name)
        for at, t in real(self, key, *args, **kwargs):
            log.elements += t.numel()
            log.by_key[key] += t.numel()
            log.dtypes.add(t.dtype)
            yield at, t

    real_into = getattr(ShardFile.read_rows_into, "real", ShardFile.read_rows_into)

    def read_rows_into(self: ShardFile, key: str, rows: tuple[int, int], out: torch.Tensor, *args: Any,
                       **kwargs: Any) -> None:  # (straight into `out`, or through the block buffer: counted once)
        log.files.add(self.file.name)
        log.elements += out.numel()
        log.by_key[key] += out.numel()
        log.dtypes.add(self.tensors[key].dtype)
        real_into(self, key, rows, out, *args, **kwargs)

    blocks.real = real  # type: ignore[attr-defined]
    read_rows_into.real = real_into  # type: ignore[attr-defined]
    ShardFile.blocks = blocks  # type: ignore[method-assign]
    ShardFile.read_rows_into = read_rows_into  # type: ignore[method-assign]
    return log


@pytest.fixture
def reads() -> Any:
    real, real_into = ShardFile.blocks, ShardFile.read_rows_into
    yield count_reads()
    ShardFile.blocks, ShardFile.read_rows_into = real, real_into  # type: ignore[method-assign]


# -- each rank's share, from the shapes alone ----------------------------------------------------------------
def vocab_rows(cfg: ModelConfig, tp: int, rank: int) -> int:
    """Real (not padding) vocabulary rows in rank's slice of the padded vocabulary."""
    per = cfg.padded_vocab // tp
    return max(0, min(cfg.vocab_size, (rank + 1) * per) - rank * per)


def llama_share(cfg: ModelConfig, tp: int, rank: int) -> int:
    C, hd, H = cfg.n_embd, cfg.head_dim, cfg.ffn_hidden
    q_heads, kv_heads = cfg.n_head // tp, max(1, cfg.kv_heads // tp)  # fewer KV heads than ranks: one each, shared
    layer = (q_heads + 2 * kv_heads) * hd * C + C * q_heads * hd + 3 * (H // tp) * C + 2 * C
    head = 1 if cfg.tie_embeddings else 2
    return cfg.n_layer * layer + head * vocab_rows(cfg, tp, rank) * C + C


def gpt2_share(cfg: ModelConfig, tp: int, rank: int) -> int:
    C, H = cfg.n_embd, cfg.ffn_hidden
    # column layers: rows (and bias) split; row layers: columns split, bias whole on every rank; norms whole
    layer = 3 * C // tp * (C + 1) + (C * C // tp + C) + H // tp * (C + 1) + (C * H // tp + C) + 4 * C
    return cfg.n_layer * layer + cfg.block_size * C + vocab_rows(cfg, tp, rank) * C + 2 * C


def file_elements(path: Path) -> int:
    return sum(t.numel() for k, t in read_hf_tensors(path).items() if not hf_module._IGNORED.search(k))


TOKENS = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(9)
    return save(hf_llama(), tmp_path_factory.mktemp("hf") / "llama")


@pytest.fixture(scope="module")
def sharded_dir(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.Tensor]:
    """4 layers in many shards, one KV head (at tp=2 both ranks hold it); and transformers' logits of TOKENS."""
    torch.manual_seed(8)
    hf = hf_llama(num_hidden_layers=4, num_key_value_heads=1)
    path = tmp_path_factory.mktemp("hf") / "sharded"
    hf.save_pretrained(path, max_shard_size="60KB")
    assert (path / "model.safetensors.index.json").is_file() and not (path / "model.safetensors").exists()
    return path, hf_logits(hf, TOKENS)


# -- tensor parallel ---------------------------------------------------------------------------------------
def _materialise_buffers(model: GPT) -> None:
    """What the model builder does for buffers after a meta build (the loader fills parameters only)."""
    for module in model.modules():
        for name, buf in list(module._buffers.items()):
            if buf is not None and buf.is_meta:
                module._buffers[name] = torch.empty_like(buf, device="cpu")
    if model.rope is not None:
        model.rope.reset_parameters()


def _load_at_tp(rank: int, world_size: int, out_dir: Path, hf_dir: Path, meta: bool,
                tokens: torch.Tensor) -> dict[str, Any]:
    from dist_llm.parallel.tensor.plan import TensorParallelFactory

    cfg = resolve_architecture(load_config(None, tiny_overrides(out_dir, parallel__tp=world_size,
                                                                model__init_from=f"hf:{hf_dir}")))
    ctx = ParallelContext.from_config(cfg)
    try:
        layers = TensorParallelFactory(cfg, ctx)
        if meta:
            with torch.device("meta"):
                model = GPT(cfg.model, layers)
        else:  # materialised: filled in place (NaN first, so nothing left over could pass)
            model = GPT(cfg.model, layers)
            for p in model.parameters():
                p.data.fill_(math.nan)
            # to_empty leaves the row indexes (non-persistent buffers) holding anything, even a plausible
            # index (increasing, in range) of other rows: the region comes from the layer's plan (tp_slice),
            # never from that buffer
            for m in model.modules():
                if isinstance(getattr(m, "rows", None), torch.Tensor):
                    m.rows.copy_(torch.arange(len(m.rows)))
        marks = {n: (getattr(p, "tp_partition_dim", None), p.requires_grad) for n, p in model.named_parameters()}
        log = count_reads()
        load_initial_weights(model, cfg, ctx)
        _materialise_buffers(model)
        assert {n: (getattr(p, "tp_partition_dim", None), p.requires_grad) for n, p in model.named_parameters()} == marks
        assert not any(p.is_meta for p in model.parameters())
        assert (model.lm_head.weight is model.wte.weight) == cfg.model.tie_embeddings
        with torch.no_grad():
            logits = model.eval()(tokens)
        return {"elements": log.elements, "files": sorted(log.files), "logits": logits, "cfg": cfg.model}
    finally:
        ctx.destroy()


@pytest.mark.parametrize("family, meta", [("llama-sharded", False), ("gpt2", True)])
def test_each_tp_rank_reads_only_its_slice(family: str, meta: bool, tmp_path: Path,
                                           sharded_dir: tuple[Path, torch.Tensor]) -> None:
    if family == "gpt2":
        torch.manual_seed(7)
        hf = hf_gpt2()
        path, ref = save(hf, tmp_path / "hf"), hf_logits(hf, TOKENS)
    else:
        path, ref = sharded_dir
    results = run_distributed(_load_at_tp, 2, tmp_path / "run", path, meta, TOKENS, init_group=False)
    cfg = results[0]["cfg"]
    share = gpt2_share if family == "gpt2" else llama_share
    for rank, r in enumerate(results):
        torch.testing.assert_close(r["logits"], ref, rtol=1e-5, atol=1e-5)
        assert r["elements"] == share(cfg, 2, rank), rank
    whole, one = file_elements(path), share(cfg, 1, 0)
    assert whole == one  # the formula counts the checkpoint right at tp=1
    if family == "llama-sharded":  # together: the checkpoint once, plus what both ranks hold: the KV head, the norms
        kv, norms = cfg.head_dim * cfg.n_embd * 2 * cfg.n_layer, (2 * cfg.n_layer + 1) * cfg.n_embd
        assert sum(r["elements"] for r in results) == whole + kv + norms


def test_a_tied_model_untied_by_to_empty_is_tied_again(tmp_path: Path, reads: ReadLog) -> None:
    torch.manual_seed(6)
    hf = hf_gpt2()
    path = save(hf, tmp_path / "hf")
    cfg = resolve_architecture(load_config(None, tiny_overrides(tmp_path, model__init_from=f"hf:{path}")))
    ctx = ParallelContext(rank=0, world_size=1, local_rank=0, dp=1, tp=1, pp=1, device=torch.device("cpu"))
    with torch.device("meta"):
        model = GPT(cfg.model)
    model.to_empty(device="cpu")  # a new tensor per module: wte and lm_head no longer share one
    assert model.lm_head.weight is not model.wte.weight
    load_initial_weights(model, cfg, ctx)
    assert model.lm_head.weight is model.wte.weight
    assert reads.elements == file_elements(path)  # the embedding read once
    with torch.no_grad():
        torch.testing.assert_close(model.eval()(TOKENS), hf_logits(hf, TOKENS), rtol=1e-5, atol=1e-5)


# -- pipeline stage ------------------------------------------------------------------------------------------
def test_a_pipeline_stage_reads_only_its_blocks_and_their_shards(tmp_path: Path, reads: ReadLog,
                                                                 sharded_dir: tuple[Path, torch.Tensor]) -> None:
    from dist_llm.parallel.pipeline.stage import cut_to_stage

    path = sharded_dir[0]
    weight_map = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    cfg = resolve_architecture(load_config(None, tiny_overrides(tmp_path, model__init_from=f"hf:{path}")))
    ctx = ParallelContext(rank=0, world_size=1, local_rank=0, dp=1, tp=1, pp=1, device=torch.device("cpu"))
    full = load_hf_state_dict(path, cfg.model)
    for stage in (0, 1):
        with torch.device("meta"):
            model = GPT(cfg.model)
        blocks, first, last = cut_to_stage(model, cfg, 2, stage)
        reads.elements, reads.files = 0, set()
        load_initial_weights(model, cfg, ctx)
        params = dict(model.named_parameters())
        assert params and all(torch.equal(p, full[n]) for n, p in params.items())
        assert reads.elements == sum(p.numel() for p in params.values()) - (cfg.model.padded_vocab - VOCAB) * cfg.model.n_embd
        wanted = {weight_map[k] for k in weight_map
                  if any(f"layers.{i}." in k for i in blocks) or (first and "embed" in k)
                  or (last and ("lm_head" in k or k == "model.norm.weight"))}
        assert reads.files == wanted and len(wanted) < len(set(weight_map.values()))


# -- FSDP2 ---------------------------------------------------------------------------------------------------
def _load_fsdp(rank: int, world_size: int, hf_dir: Path, cfg: ModelConfig, meta: bool) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    config = Config(model=dataclasses_replace(cfg, init_from=f"hf:{hf_dir}"))
    ctx = ParallelContext(rank=rank, world_size=world_size, local_rank=rank, dp=world_size, tp=1, pp=1,
                          device=torch.device("cpu"))
    with torch.device("meta" if meta else "cpu"):
        model = GPT(cfg)
    mesh = init_device_mesh("cpu", (world_size,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if not meta:
        with torch.no_grad():
            for p in model.parameters():
                p.to_local().fill_(math.nan)
    log = count_reads()
    load_initial_weights(model, config, ctx)
    out = {"elements": log.elements, "params": {n: p.full_tensor() for n, p in model.named_parameters()},
           "local": sum(p.to_local().numel() for p in model.parameters())}
    _materialise_buffers(model)
    with torch.no_grad():  # FSDP2 gathers what was loaded
        out["logits"] = model.eval()(TOKENS)
    return out


def dataclasses_replace(cfg: ModelConfig, **kw: Any) -> ModelConfig:
    import dataclasses

    return dataclasses.replace(cfg, **kw)


@pytest.mark.parametrize("meta", [False, True], ids=["materialised", "meta"])
def test_fsdp2_shards_read_only_their_rows(llama_dir: Path, meta: bool) -> None:
    path = llama_dir
    ref = load_hf(path)
    cfg = ref.cfg
    full = load_hf_state_dict(path, cfg)
    results = run_distributed(_load_fsdp, 2, path, cfg, meta)
    with torch.no_grad():
        ref_logits = ref(TOKENS)
    for r in results:
        torch.testing.assert_close(r["logits"], ref_logits, rtol=1e-5, atol=1e-5)
    padding = (cfg.padded_vocab - VOCAB) * cfg.n_embd
    for r in results:
        for name, t in full.items():
            assert torch.equal(r["params"][name], t), name
        assert r["elements"] <= r["local"]  # (vocabulary padding rows are not read)
    assert sum(r["elements"] for r in results) == file_elements(path)  # every element once, by one rank
    assert sum(r["local"] for r in results) - sum(r["elements"] for r in results) == 2 * padding


# -- dtypes, QLoRA, errors -----------------------------------------------------------------------------------
def test_bf16_files_are_read_as_bf16_and_converted_per_tensor(tmp_path: Path, reads: ReadLog, llama_dir: Path) -> None:
    from safetensors.torch import load_file, save_file

    path = tmp_path / "bf16"
    path.mkdir()
    (path / "config.json").write_bytes((llama_dir / "config.json").read_bytes())
    tensors = {k: t.bfloat16() for k, t in load_file(str(llama_dir / "model.safetensors")).items()}
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    cfg = load_hf(path).cfg
    reads.dtypes.clear()
    with HFCheckpoint(path, cfg) as src:
        for name, mapping in src.layout.items():
            got = src.read(name, dtype=torch.float32)
            assert got.dtype == torch.float32 and got.shape == mapping.shape
            native = src.read(name, dtype=torch.bfloat16)
            assert torch.equal(native.float(), got), name  # bf16 -> fp32 is exact
    assert reads.dtypes == {torch.bfloat16}
    model = load_hf(path)
    assert torch.equal(model.blocks[1].mlp.down.weight, tensors["model.layers.1.mlp.down_proj.weight"].float())


def test_qlora_quantises_each_layer_as_it_is_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                  llama_dir: Path) -> None:
    from dist_llm.peft import BLOCK_LINEARS, apply_peft
    from dist_llm.peft.nf4 import NF4Linear

    path = llama_dir
    cfg = resolve_architecture(load_config(None, tiny_overrides(
        tmp_path, model__init_from=f"hf:{path}", peft__method="qlora", peft__targets="[qkv,attn_out,mlp_up,mlp_down]")))
    ctx = ParallelContext(rank=0, world_size=1, local_rank=0, dp=1, tp=1, pp=1, device=torch.device("cpu"))
    with torch.device("meta"):
        model = GPT(cfg.model)
    live: list[int] = []  # at each read: block linear weights that exist in fp32
    real = HFCheckpoint.read_into

    def read_into(self: HFCheckpoint, *args: Any, **kwargs: Any) -> torch.Tensor:
        live.append(sum(1 for m in model.blocks.modules() if isinstance(m, nn.Linear) and not m.weight.is_meta))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(HFCheckpoint, "read_into", read_into)
    load_initial_weights(model, cfg, ctx)
    assert max(live) == 0  # (no biases here: each weight is quantised before anything else is read)
    layers = {path: block.get_submodule(path) for block in model.blocks for path in BLOCK_LINEARS}
    assert all(isinstance(m, NF4Linear) for m in layers.values())
    # the same NF4 as quantising the whole fp32 model, as apply_peft did before
    ref = load_hf(path, cfg.model)
    apply_peft(ref, cfg.peft, seed=cfg.train.seed)
    apply_peft(model, cfg.peft, seed=cfg.train.seed)  # leaves the quantised layers as they are
    mine, theirs = model.state_dict(), ref.state_dict()
    assert sorted(mine) == sorted(theirs)
    for name, t in theirs.items():
        assert torch.equal(mine[name], t), name


def test_bad_weights_are_one_line_naming_file_and_key(tmp_path: Path, llama_dir: Path) -> None:
    from safetensors.torch import load_file, save_file

    good = llama_dir
    cfg = load_hf(good).cfg

    def variant(name: str, edit: Any) -> Path:
        import shutil

        shutil.copytree(good, tmp_path / name)
        tensors = load_file(str(good / "model.safetensors"))
        edit(tensors)
        save_file(tensors, str(tmp_path / name / "model.safetensors"), metadata={"format": "pt"})
        return tmp_path / name

    key = "model.layers.1.mlp.up_proj.weight"
    cases = {
        "missing": (variant("missing", lambda t: t.pop(key)), "missing tensor 'layers.1.mlp.up_proj.weight'"),
        "shape": (variant("shape", lambda t: t.update({key: t[key][:-1]})),
                  f"model.safetensors: tensor '{key}' has shape (95, 64), the config.json implies (96, 64)"),
        "extra": (variant("extra", lambda t: t.update({"model.layers.0.q_norm.weight": torch.ones(4)})),
                  "model.safetensors: unexpected tensor 'layers.0.q_norm.weight'"),
    }
    (tmp_path / "garbage").mkdir()
    (tmp_path / "garbage" / "config.json").write_bytes((good / "config.json").read_bytes())
    (tmp_path / "garbage" / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
    cases["unreadable"] = (tmp_path / "garbage", "model.safetensors: cannot read weights")
    for name, (where, message) in cases.items():
        with pytest.raises(ConfigError) as e:
            HFCheckpoint(where, cfg)
        assert message in str(e.value) and len(str(e.value).splitlines()) == 1, (name, str(e.value))


def test_a_weight_index_naming_a_file_elsewhere_is_refused(tmp_path: Path) -> None:
    """A shard listed as a path (`../x`, absolute) would read another file's bytes into the model; a value that
    is no file name is a damaged index: each one line naming the index."""
    index = tmp_path / "model.safetensors.index.json"
    for shard, why in (("../outside.safetensors", "names a shard '../outside.safetensors' outside its directory"),
                       ("/etc/passwd", "names a shard '/etc/passwd' outside its directory"),
                       (1, "not a weight index \\(weight_map maps 'a' to 1, not a file name\\)")):
        index.write_text(json.dumps({"weight_map": {"a": shard}}))
        with pytest.raises(ConfigError, match=rf"^{re.escape(str(index))}: {why}$"):
            hf_module.read_weight_map(index)
    index.write_text(json.dumps({"weight_map": {"a": "model-1.safetensors"}}))
    assert hf_module.read_weight_map(index) == {"a": tmp_path / "model-1.safetensors"}


def test_a_forged_safetensors_header_is_refused_before_it_is_read(tmp_path: Path) -> None:
    """Headers are read on every rank before anything else: a length past safetensors' own 100 MB bound, an
    integer tensor where a weight belongs, a negative dimension: one line naming the file, nothing allocated."""
    from safetensors.torch import save_file

    file = tmp_path / "w.safetensors"
    save_file({"w": torch.zeros(2, 3, dtype=torch.int64)}, str(file))
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(file))}: cannot read weights .*'w' is I64, not a "
                                          "floating-point weight"):
        hf_module._safetensors_header(file)
    with open(file, "r+b") as f:  # the header length field claims 2**40 bytes
        f.write((2**40).to_bytes(8, "little"))
    with pytest.raises(ConfigError, match=rf"^{re.escape(str(file))}: cannot read weights .*header length "
                                          f"{2**40} does not fit"):
        hf_module._safetensors_header(file)
    header = json.dumps({"w": {"dtype": "F32", "shape": [-1, 3], "data_offsets": [0, 0]}}).encode()
    file.write_bytes(len(header).to_bytes(8, "little") + header)
    with pytest.raises(ConfigError, match=r"negative dimension \(-1, 3\)"):
        hf_module._safetensors_header(file)


@pytest.mark.parametrize("kind", ["gpt2", "llama-sharded", "gpt2-bin"])
def test_a_layer_count_past_the_files_is_refused_before_a_model_is_built(tmp_path: Path, kind: str,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """config.json claiming 3,000,000 layers over files of 2: before, the meta model of that many blocks was being
    built for minutes (a review); now one line from the tensor names alone, no model built (GPT is not called)."""
    model = hf_llama() if kind == "llama-sharded" else hf_gpt2()
    if kind == "gpt2":
        save(model, tmp_path)
    elif kind == "gpt2-bin":  # pytorch_model.bin: the names from the mapped pickle
        save(model, tmp_path)
        torch.save(hf_module.read_hf_tensors(tmp_path), tmp_path / "pytorch_model.bin")
        (tmp_path / "model.safetensors").unlink()
    else:  # (shards with their index: the names come from the index's map)
        model.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="100KB")
        assert (tmp_path / "model.safetensors.index.json").is_file()
    config = json.loads((tmp_path / "config.json").read_text())
    config["num_hidden_layers" if kind == "llama-sharded" else "n_layer"] = 3_000_000
    (tmp_path / "config.json").write_text(json.dumps(config))

    def no_model(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a model was built")

    monkeypatch.setattr("dist_llm.model.gpt.GPT.__init__", no_model)
    with pytest.raises(ConfigError) as info:
        hf_module.model_config_from_hf(tmp_path)
    assert str(info.value) == f"{tmp_path / 'config.json'}: 3000000 layers, but the weight files of {tmp_path} hold 2"


def test_a_bin_weight_of_integers_or_a_bin_of_no_dict_is_refused(tmp_path: Path) -> None:
    """pytorch_model.bin is checked as safetensors headers are: an integer tensor where a weight belongs was
    imported (cast to float) without a word (a review); a pickle of a list was an AttributeError traceback."""
    save(hf_gpt2(), tmp_path)
    cfg = hf_module.model_config_from_hf(tmp_path)
    state = hf_module.read_hf_tensors(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    state["transformer.h.0.mlp.c_fc.weight"] = state["transformer.h.0.mlp.c_fc.weight"].to(torch.int32)
    torch.save(state, tmp_path / "pytorch_model.bin")
    for read in (lambda: HFCheckpoint(tmp_path, cfg), lambda: hf_module.model_config_from_hf(tmp_path)):
        with pytest.raises(ConfigError) as info:
            read()
        assert str(info.value) == (f"{tmp_path / 'pytorch_model.bin'}: cannot read weights (tensor "
                                   "'transformer.h.0.mlp.c_fc.weight' is torch.int32, not a floating-point weight)")
    torch.save([1, 2], tmp_path / "pytorch_model.bin")
    with pytest.raises(ConfigError) as info:
        HFCheckpoint(tmp_path, cfg)
    assert str(info.value) == f"{tmp_path / 'pytorch_model.bin'}: cannot read weights (it holds a list, not tensors by name)"
