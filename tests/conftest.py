"""Shared test set-up: a data cache that lives for the session (and across xdist workers), tiny configs."""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import Callable, TypeVar

import pytest

T = TypeVar("T")

REPO = Path(__file__).resolve().parents[1]
# Prepared token files are shared by all workers (writes are atomic renames); CI points this into the checkout.
os.environ.setdefault("DIST_LLM_CACHE", str(REPO / ".cache" / "dist_llm"))
os.environ.setdefault("OMP_NUM_THREADS", "1")
# DeepSpeed JIT-builds a C++ op on first use; one cache for the whole run
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(REPO / ".cache" / "torch_extensions"))


def tiny_overrides(out_dir: Path, **extra: object) -> list[str]:
    """A model small enough that a step takes milliseconds; extra keys as section__key=value."""
    base = {
        "model.n_layer": 2, "model.n_head": 4, "model.n_embd": 32, "model.block_size": 32,
        "train.micro_batch_size": 4, "train.global_batch_size": 8, "train.max_steps": 20,
        "train.log_interval": 1, "train.eval_interval": 10, "train.eval_steps": 2,
        "train.plot": False,  # (matplotlib: half a second a run; the tests of the plots ask for them)
        "train.out_dir": str(out_dir), "optim.warmup_steps": 5,
    }
    base.update({k.replace("__", "."): v for k, v in extra.items()})
    return [f"{k}={v}" for k, v in base.items()]


def made_once(config: pytest.Config, tmp_path_factory: pytest.TempPathFactory, name: str,
              make: Callable[[Path], T]) -> T:
    """`make(folder)` run once in the whole test session, by whichever xdist worker asks first; the others wait for
    it and get the same result (pickled) and folder, which they must only read. For the expensive module fixtures:
    the slow-first order (pytest_collection_modifyitems) scatters a module's tests over both workers and between
    other modules, and a module fixture was rebuilt each time (test_launch's reference 4 times a run). The result
    is written whole or not at all, and a try finds no result starts from an empty folder: what a `make` that
    raised (or a worker killed in it) left there is removed, not resumed from. (`make` works in the final folder:
    its outputs name it, as the Ctrl-C run's messages do.)"""
    import shutil

    from filelock import FileLock  # (torch's dependency)

    root = tmp_path_factory.getbasetemp()
    if getattr(config, "workerinput", None) is not None:  # an xdist worker: its basetemp is <session>/gwN
        root = root.parent
    folder, done = root / f"made-once-{name}", root / f"made-once-{name}.pickle"
    with FileLock(f"{folder}.lock"):
        if not done.is_file():
            shutil.rmtree(folder, ignore_errors=True)
            folder.mkdir()
            result = make(folder)
            part = done.with_suffix(".part")
            part.write_bytes(pickle.dumps(result))
            os.replace(part, done)
    return pickle.loads(done.read_bytes())


@pytest.fixture
def corpus_file(tmp_path: Path) -> Path:
    """A ~150 KB text file (fast to prepare; split by position) for trainer tests that need no stdlib."""
    import sysconfig

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    names = ["argparse.py", "dataclasses.py", "functools.py", "json/decoder.py", "textwrap.py", "string.py"]
    path = tmp_path / "corpus.txt"
    path.write_text("\n".join((stdlib / name).read_text() for name in names))
    return path


# Tests that take many seconds, with about how many (CI, 2 workers; a parametrized test's every case). pytest-xdist
# (--dist loadgroup) hands each worker the next test as it runs dry, in collection order: the long ones go first,
# so that the run does not end with one worker on a long test while the other idles.
SLOW_S: dict[str, float] = {
    "test_compile_parallel.py::test_compiled_layouts_equal_eager": 75,  # (Inductor cold, as in CI)
    "test_reliability.py::test_torchrun_restarts_a_killed_worker_from_the_last_checkpoint": 53,
    "test_moe_deepspeed.py::test_ep2_checkpoint_resumes_at_deepspeed_zero0_1_and_3": 52,
    "test_deepspeed.py::test_deepspeed_zero2_matches_ours": 36,
    "test_deepspeed.py::test_deepspeed_skipped_steps_come_from_the_engine": 35,
    "test_reliability.py::test_a_real_write_error_stops_with_one_line_and_keeps_the_checkpoint": 32,
    "test_launch.py::test_two_torchrun_nodes_dp2_tp2": 25,
    "test_finetune.py::test_shipped_finetune_configs_lower_the_loss": 20,
    "test_reliability.py::test_sigterm_saves_and_exits_0_then_resume_goes_on": 22,
    "test_trainer.py::test_compile_matches_eager": 20,
    "test_launch.py::test_deepspeed_launcher": 19,
    "test_launch.py::test_accelerate_launch_multi_cpu": 19,
    "test_launch.py::test_slurm_sbatch_with_fake_srun": 18,
    "test_resume_safety.py::test_the_only_checkpoint_damaged_stops_resume_and_never_deletes_it": 17,
    "test_console.py::test_two_ranks_print_one_bar_val_loss_once_a_summary_and_log_every_step": 17,
    "test_cli.py::test_nproc_per_node_relaunches_under_torchrun": 16,
    "test_cli.py::test_train_then_sample": 16,
    "test_stop_during_build.py::test_a_sigterm_after_the_last_save_lets_the_complete_run_exit_0": 15,
    "test_deepspeed.py::test_deepspeed_zero1_bf16_resume_gives_uninterrupted_losses": 15,
    "test_moe_deepspeed.py::test_zero2_matches_one_process_and_resumes_at_ep2": 15,
    "test_moe_deepspeed_hf.py::test_zero3_from_hf_mixtral_and_qwen2_moe_is_the_file_and_trains_as_one_process": 8,
    "test_readme.py::test_every_readme_command_runs_as_written": 12,
    "test_deepspeed_qlora.py::test_qlora_at_zero3_trains_to_the_one_process_losses": 12,
    "test_reliability.py::test_a_stuck_rank_becomes_an_error_naming_the_collective_and_rank": 12,
    "test_qlora_zero3.py::test_a_zero3_checkpoint_resumes_at_zero3_and_in_one_process": 12,
    "test_moe_zero3.py::test_an_ep4_run_matches_and_its_checkpoint_resumes_at_tp2_and_pp2": 12,
    "test_launch.py::test_single_node_script": 12,
    "test_reliability.py::test_consolidated_file_of_any_layout": 11,
    "test_reliability.py::test_3d_checkpoint_resumes_at_other_layouts": 11,
    "test_stop_during_build.py::test_a_sigterm_to_the_launcher_during_the_build_of_two_ranks": 10,
    "test_reliability.py::test_loading_a_checkpoint_runs_no_code_from_it": 8,
    "test_cli.py::test_bad_layout_exits_2": 8,
    "test_launch.py::test_3d_config_fits_its_32_ranks": 8,
    "test_deepspeed.py::test_deepspeed_resume_keeps_the_configs_optimizer_hyperparameters": 8,
    "test_reliability.py::test_async_checkpoint_equals_the_synchronous_one": 8,
    "test_init_draws.py::test_each_rank_draws_only_what_it_holds": 10,
    "test_pipeline.py::test_stages_hold_the_schedules_micro_batches": 7,
}


def _expected_s(nodeid: str) -> float:
    name = nodeid.split("[", 1)[0].removeprefix("tests/")
    return SLOW_S.get(name, 0.0)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # stable: the rest keep their order; every xdist worker computes the same order, as it must
    items.sort(key=lambda item: -_expected_s(item.nodeid))
