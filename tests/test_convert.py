"""`dist-llm convert --to-hf / --to-full` stream: one tensor at a time from a checkpoint of any layout, into
sharded safetensors past --max-shard-size; and the layering around it (hf.py a pure mapping, no import loop)."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from dist_llm import convert
from dist_llm.config import ConfigError, load_config
from dist_llm.parallel.context import ParallelContext
from dist_llm.safetensors_shards import Entry, parse_shard_size, plan_shards
from tests.conftest import REPO, tiny_overrides
from tests.distributed import run_distributed
from tests.test_data_parallel import corpus  # noqa: F401

# Llama-shaped (q/k/v cut from the fused qkv, grouped-query attention), untied head, the vocabulary padded
# (256 -> 288: padding rows are stripped on export), biases on (every Llama bias kind is written)
LLAMA = {"model__pos_emb": "rope", "model__norm": "rmsnorm", "model__mlp": "swiglu", "model__n_kv_head": 2,
         "model__tie_embeddings": False, "model__pad_vocab_to": 96, "model__bias": True}


def save_at_init(rank: int, world_size: int, out_dir: Path, corpus: Path, extra: dict[str, Any]) -> str:
    """A trainer of this layout saves its step-0 checkpoint: the seeded init, bit for bit the same weights at
    every layout (in fp32 on the CPU), each rank writing its own part."""
    from dist_llm.train.trainer import Trainer

    cfg = load_config(None, tiny_overrides(out_dir, **{"data__source": str(corpus), **LLAMA, **extra}))
    ctx = ParallelContext.from_config(cfg)
    try:
        trainer = Trainer(cfg, ctx)
        path = trainer.save_checkpoint()
        trainer.wait_for_save()
        return str(path)
    finally:
        ctx.destroy()


def files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


@pytest.fixture(scope="module")
def one_process(tmp_path_factory: pytest.TempPathFactory, corpus: Path) -> Path:  # noqa: F811
    return Path(save_at_init(0, 1, tmp_path_factory.mktemp("one"), corpus, {}))


@pytest.mark.parametrize("layout", [{"parallel__tp": 2}, {"parallel__pp": 2, "parallel__dp": 2,
                                                         "parallel__zero_stage": 2}], ids=["tp2", "pp2-dp2-zero2"])
def test_export_of_any_layout_is_the_one_process_export_byte_for_byte(tmp_path: Path, corpus: Path,  # noqa: F811
                                                                       one_process: Path, layout: dict) -> None:
    world = 2 * (2 if "parallel__dp" in layout else 1)
    [saved, *_] = run_distributed(save_at_init, world, tmp_path / "run", corpus,
                                  {"train__micro_batch_size": 2, **layout}, init_group=False)
    for name, path in (("one", one_process), ("layout", Path(saved))):
        convert.convert_checkpoint_to_hf(path, tmp_path / f"hf-{name}")
        convert.save_full(path, tmp_path / f"full-{name}.safetensors")
    assert files(tmp_path / "hf-layout") == files(tmp_path / "hf-one")
    assert (tmp_path / "full-layout.safetensors").read_bytes() == (tmp_path / "full-one.safetensors").read_bytes()


def save_resharded_copy(rank: int, world_size: int, src: str, dst: str) -> None:
    """The model tensors of the checkpoint `src` saved again by `world_size` ranks as DTensor shards (columns of
    every matrix, rows of every vector): each rank writes only its own chunk of each tensor, with its global
    offsets, as a shard-native save does; the small files are copied, and the manifest lists what this copy holds
    (every reader checks a checkpoint against its manifest)."""
    import shutil

    import torch.distributed.checkpoint as dcp

    from dist_llm.train import checksums
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world_size,))
    weights = convert.CheckpointWeights(Path(src))
    state = {key: distribute_tensor(weights.get(key.removeprefix("model.")), mesh,
                                    [Shard(min(1, len(meta.size) - 1))])
             for key, meta in weights.index.items() if key.startswith("model.")}
    dcp.save(state, checkpoint_id=dst)
    if rank == 0:
        for name in ("config.yaml", "train_state.json"):
            shutil.copyfile(Path(src) / name, Path(dst) / name)
        manifest = json.loads((Path(src) / "manifest.json").read_text())
        manifest["files"] = checksums.hash_files(Path(dst), checksums.checkpoint_files(Path(dst)))
        (Path(dst) / "manifest.json").write_text(json.dumps(manifest))


def test_export_of_a_checkpoint_in_chunks_is_the_same(tmp_path: Path, one_process: Path) -> None:
    """DCP reassembles each tensor from chunks that several ranks wrote (column slices: not contiguous)."""
    from dist_llm.train.checkpoint import SafeReader

    run_distributed(save_resharded_copy, 2, str(one_process), str(tmp_path / "chunks"))
    index = SafeReader(str(tmp_path / "chunks")).read_metadata().state_dict_metadata
    assert len(index["model.blocks.0.attn.qkv.weight"].chunks) == 2  # really saved in pieces
    convert.convert_checkpoint_to_hf(one_process, tmp_path / "hf-one")
    convert.convert_checkpoint_to_hf(tmp_path / "chunks", tmp_path / "hf-chunks")
    assert files(tmp_path / "hf-chunks") == files(tmp_path / "hf-one")


def test_sharded_export_loads_in_transformers(tmp_path: Path, one_process: Path) -> None:
    transformers = pytest.importorskip("transformers")
    from safetensors import safe_open

    from dist_llm.cli import main

    model = convert.load_checkpoint_model(one_process)
    with torch.no_grad():  # norms start at one and biases at zero: move them so the mapping shows
        for name, p in model.named_parameters():
            p.add_(torch.randn_like(p) * 0.1 if "ln" in name or name.endswith("bias") else 0)
    # re-saved as a one-process checkpoint of these weights, through the save path training uses
    src = tmp_path / "src"
    convert.save_hf(model, src)
    ckpt_dir = convert.convert_hf_to_checkpoint(src, tmp_path / "ckpt", pad_vocab_to=96)
    assert main(["convert", "--to-hf", str(ckpt_dir), "--out", str(tmp_path / "hf"), "--max-shard-size", "40KB"]) == 0
    out = tmp_path / "hf"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and shards == sorted(p.name for p in out.glob("model-*-of-*.safetensors"))
    assert shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    sizes = {}
    for shard in shards:
        with safe_open(str(out / shard), framework="pt") as f:
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        assert all(index["weight_map"][k] == shard for k in tensors)
        shard_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
        assert shard_bytes <= 40_000 or len(tensors) == 1, shard  # a tensor over the limit has a file of its own
        sizes.update({k: t.numel() * t.element_size() for k, t in tensors.items()})
    assert index["metadata"]["total_size"] == sum(sizes.values()) and set(sizes) == set(index["weight_map"])
    hf = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    tokens = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, theirs = model.eval()(tokens), hf(tokens).logits
    torch.testing.assert_close(theirs, ours[..., :256], rtol=0, atol=2e-5)  # fp32: summation order only
    # and read back tensor by tensor through the index (a PEFT base is read so): our weights exactly
    back = convert.HFWeights(out, model.cfg)
    for name, t in model.state_dict().items():
        got = back.get(name)
        if name in ("wte.weight", "lm_head.weight"):  # the padding rows are not exported: they come back zero
            assert torch.equal(got[:256], t[:256]) and not got[256:].any(), name
        else:
            assert torch.equal(got, t), name

    # --to-full: a directory of shards by our names, which load_full reads back exactly
    assert main(["convert", "--to-full", str(ckpt_dir), "--out", str(tmp_path / "full"), "--max-shard-size",
                 "40KB"]) == 0
    assert len(list((tmp_path / "full").glob("model-*-of-*.safetensors"))) > 2
    with torch.no_grad():
        torch.testing.assert_close(convert.load_full(tmp_path / "full")(tokens), ours, rtol=0, atol=0)


def test_export_loads_one_tensor_at_a_time(tmp_path: Path, one_process: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every read of an export is of one model tensor, none larger than the largest parameter, each once;
    nothing builds the whole model."""
    from dist_llm.convert_io import ChunkReader

    loads: list[tuple[str, int]] = []
    real_read = ChunkReader.read_whole

    def counting_read(self: ChunkReader, key: str) -> torch.Tensor:
        t = real_read(self, key)
        loads.append((key, t.numel()))
        return t

    def no_whole_model(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("the export built the whole model")

    monkeypatch.setattr(ChunkReader, "read_whole", counting_read)
    monkeypatch.setattr("dist_llm.sample.load_model", no_whole_model)
    monkeypatch.setattr("dist_llm.train.trainer.build_model", no_whole_model)
    convert.convert_checkpoint_to_hf(one_process, tmp_path / "hf", max_shard_size="20KB")
    cfg = load_config(None, tiny_overrides(tmp_path, **LLAMA))
    shapes = convert.weight_shapes(cfg.model)
    largest = max(torch.Size(s).numel() for s in shapes.values())
    assert sorted(k for k, _ in loads) == sorted(f"model.{n}" for n in shapes)  # each tensor once
    assert max(n for _, n in loads) == largest
    loads.clear()
    convert.save_full(one_process, tmp_path / "full", max_shard_size="20KB")
    assert len(loads) == len(shapes) and max(n for _, n in loads) == largest


def test_shard_sizes_parse_as_transformers_reads_them() -> None:
    assert parse_shard_size("5GB") == 5 * 10**9
    assert parse_shard_size("500MB") == 500 * 10**6
    assert parse_shard_size("2GiB") == 2 * 2**30
    assert parse_shard_size(" 1.5kib") == 1536 and parse_shard_size("1000") == 1000
    for bad in ("five GB", "0", "-1MB", ""):
        with pytest.raises(ConfigError, match="^--max-shard-size: "):
            parse_shard_size(bad)
    f32 = torch.float32
    entries = [Entry(n, (k,), f32) for n, k in (("a", 10), ("b", 10), ("c", 30), ("d", 1))]
    # 40-byte, 40-byte, 120-byte and 4-byte tensors in files of 100 bytes: the 120 alone, the 4 after it
    assert [[e.name for e in s] for s in plan_shards(entries, 100)] == [["a", "b"], ["c"], ["d"]]


def test_to_full_file_over_the_shard_size_is_refused_in_one_line(tmp_path: Path, one_process: Path,
                                                                  capsys: pytest.CaptureFixture) -> None:
    from dist_llm.cli import main

    out = tmp_path / "m.safetensors"
    assert main(["convert", "--to-full", str(one_process), "--out", str(out), "--max-shard-size", "10KB"]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"dist-llm: error: --out: {out}: the model's ") and "give a directory" in line
    assert main(["convert", "--to-hf", str(one_process), "--out", str(tmp_path / "hf"), "--max-shard-size", "x"]) == 2
    assert "--max-shard-size: expected a size" in capsys.readouterr().err
    assert not out.exists() and not (tmp_path / "hf").exists()


# -- layering -----------------------------------------------------------------------------------------------
PACKAGE = REPO / "dist_llm"


def _is_module(name: str) -> bool:
    path = PACKAGE.parent / name.replace(".", "/")
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def module_name(file: Path) -> str:
    return ".".join(file.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")


def dist_llm_imports(file: Path) -> set[str]:
    """Every dist_llm module `file` imports, at the top or inside a function (a lazy import is a dependency
    too: it is how the loop trainer -> init_from -> hf -> sample -> trainer hid)."""
    module = module_name(file)
    found: set[str] = set()
    for node in ast.walk(ast.parse(file.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith("dist_llm")}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolved against this module's package
                parts = module.split(".")[: len(module.split(".")) - node.level + (file.name == "__init__.py")]
                base = ".".join([*parts, *([base] if base else [])])
            if base.startswith("dist_llm"):
                subs = {f"{base}.{a.name}" for a in node.names if _is_module(f"{base}.{a.name}")}
                # `from package import submodule` depends on the submodule (the package's __init__ runs first,
                # as for any import of a submodule: not a dependency of its own, or every package would loop)
                found |= subs or {base}
    return found


def test_hf_and_parallel_import_no_training_sampling_or_cli() -> None:
    forbidden = ("dist_llm.train", "dist_llm.sample", "dist_llm.cli", "dist_llm.convert")
    files = [PACKAGE / "hf.py", *sorted((PACKAGE / "parallel").rglob("*.py"))]
    for file in files:
        bad = sorted(m for m in dist_llm_imports(file) if m.startswith(forbidden))
        assert not bad, f"{file.relative_to(REPO)} imports {bad}"
    # hf.py is the pure mapping: config and model only, and leaves: the safetensors reader (imports nothing of
    # ours), the mapping's vocabulary and its MoE part (config and each other only)
    assert {m for m in dist_llm_imports(PACKAGE / "hf.py")} <= {"dist_llm.config", "dist_llm.model", "dist_llm.hf_moe",
                                                                "dist_llm.hf_mapping", "dist_llm.safetensors_read"}
    assert not dist_llm_imports(PACKAGE / "safetensors_read.py")
    assert dist_llm_imports(PACKAGE / "hf_mapping.py") <= {"dist_llm.config"}
    assert dist_llm_imports(PACKAGE / "hf_moe.py") <= {"dist_llm.config", "dist_llm.hf_mapping"}


def test_no_import_circles() -> None:
    """dist_llm's modules form no cycle of imports, lazy ones included (the rule of the layout: nothing imports
    the CLI, parallel/ never imports train/, and no circles)."""
    graph = {module_name(f): dist_llm_imports(f) for f in PACKAGE.rglob("*.py")}
    graph = {m: {d for d in deps if d in graph and d != m} for m, deps in graph.items()}
    done: set[str] = set()

    def visit(m: str, path: list[str]) -> None:
        if m in path:
            raise AssertionError("import circle: " + " -> ".join([*path[path.index(m):], m]))
        if m in done:
            return
        for dep in sorted(graph[m]):
            visit(dep, [*path, m])
        done.add(m)

    for m in sorted(graph):
        visit(m, [])


FIRSTS = ["dist_llm.hf", "dist_llm.train.init_from", "dist_llm.sample", "dist_llm.train.trainer", "dist_llm.convert",
          "dist_llm.cli"]
LOOP = ["dist_llm.train.trainer", "dist_llm.train.init_from", "dist_llm.hf", "dist_llm.sample", "dist_llm.convert"]
# One fresh interpreter for all the orders: between them every dist_llm module leaves sys.modules, so each order
# imports our modules from nothing while torch and the other libraries stay loaded (an import circle among our
# modules fails the same way; six interpreters cost six imports of torch, ~30 s of the suite on 2 cores).
_EACH_FIRST = """
import importlib, sys
for first in {firsts!r}:
    for name in [n for n in sys.modules if n == "dist_llm" or n.startswith("dist_llm.")]:
        del sys.modules[name]
    try:
        for name in [first, *[m for m in {loop!r} if m != first]]:
            importlib.import_module(name)
    except Exception as e:
        sys.exit(f"{{first}} first: {{type(e).__name__}}: {{e}}")
"""


def each_first_in_a_fresh_interpreter(firsts: list[str], loop: list[str],
                                      root: Path = REPO) -> subprocess.CompletedProcess:
    code = _EACH_FIRST.format(firsts=firsts, loop=loop)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=root, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(root)}, check=False)


def test_each_module_imports_first_in_a_fresh_interpreter() -> None:
    """The old loop's members, each imported first by a fresh interpreter, then the rest of the loop."""
    proc = each_first_in_a_fresh_interpreter(FIRSTS, LOOP)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_an_import_circle_fails_the_fresh_interpreter_check(tmp_path: Path) -> None:
    """The check above can fail, and only because each order starts from nothing: `b` first imports fine (a's
    `import dist_llm.b` finds b's module begun), `a` first does not (b asks a for a name a has not yet defined),
    which an interpreter that kept the first order's modules would never see."""
    pkg = tmp_path / "dist_llm"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("import dist_llm.b\nA = 1\n")
    (pkg / "b.py").write_text("from dist_llm.a import A\nB = 2\n")
    proc = each_first_in_a_fresh_interpreter(["dist_llm.b", "dist_llm.a"], ["dist_llm.a", "dist_llm.b"], tmp_path)
    assert proc.returncode == 1 and "dist_llm.a first: ImportError" in proc.stderr, proc.stderr


@pytest.mark.parametrize("base", ["random", "ckpt"])
def test_peft_export_of_every_base_is_the_merged_model(tmp_path: Path, corpus: Path, base: str) -> None:  # noqa: F811
    """A LoRA checkpoint over a random base (rebuilt from train.seed) or over a checkpoint (`ckpt:`, read
    tensor by tensor): its streamed export is byte for byte what merging the whole model and saving it gives."""
    from dist_llm.peft import merge_into_base
    from tests.test_data_parallel import train
    from tests.test_peft import LORA

    extra: dict[str, Any] = {**LORA, "train__max_steps": 2, "model__bias": True}
    if base == "ckpt":
        train(0, 1, tmp_path / "base", corpus, {"train__max_steps": 2, "model__bias": True})
        [start] = (tmp_path / "base" / "checkpoints").glob("step_*")
        extra["model__init_from"] = f"ckpt:{start}"
    train(0, 1, tmp_path / "run", corpus, extra)
    model = convert.load_checkpoint_model(tmp_path / "run")
    merge_into_base(model)
    convert.save_hf(model, tmp_path / "whole")
    convert.convert_checkpoint_to_hf(tmp_path / "run", tmp_path / "streamed")
    streamed = files(tmp_path / "streamed")
    # (the export also writes the run's tokenizer, which save_hf of a bare model has no way to know)
    assert sorted(streamed.keys() - files(tmp_path / "whole").keys()) == ["tokenizer.json", "tokenizer_config.json"]
    assert {k: v for k, v in streamed.items() if not k.startswith("tokenizer")} == files(tmp_path / "whole")


@pytest.mark.parametrize("family", ["gpt2", "llama", "qwen2"])
@pytest.mark.parametrize("serialization", ["safetensors", "bin"])
def test_hf_base_read_tensor_by_tensor_equals_the_whole_read(tmp_path: Path, family: str, serialization: str) -> None:
    """A PEFT base read one tensor at a time (HFWeights, the inverse of export_plan) is what load_hf_state_dict
    reads whole: Conv1D transposes, q/k/v into qkv, biases Hugging Face leaves out (qwen2's o_proj) zero, a
    tied head, the vocabulary padded; from safetensors and from memory-mapped pytorch_model.bin."""
    pytest.importorskip("transformers")
    from dist_llm.config import ModelConfig
    from dist_llm.hf import load_hf_state_dict, model_config_from_hf
    from tests.test_hf import hf_gpt2, hf_llama

    torch.manual_seed(6)
    hf = hf_gpt2() if family == "gpt2" else hf_llama(family)
    hf.save_pretrained(tmp_path, safe_serialization=serialization == "safetensors")
    cfg = model_config_from_hf(tmp_path, ModelConfig(pad_vocab_to=128))
    whole = load_hf_state_dict(tmp_path, cfg)
    lazy = convert.HFWeights(tmp_path, cfg)
    for name, t in whole.items():
        assert torch.equal(lazy.get(name), t), name
