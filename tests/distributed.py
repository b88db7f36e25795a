"""Run a test function on N gloo processes on CPU.

    @distributed(world_size=2)
    def test_allreduce(rank, world_size):
        ...                     # runs in every rank with the default process group initialised

    results = run_distributed(fn, 2, arg)   # fn(rank, world_size, arg) on 2 ranks; returns [result_0, result_1]

Each rank is a new process with the torchrun environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR,
MASTER_PORT) set, so code under test sees what it sees under torchrun. Ranks are forked from a server process
that has already imported torch and dist_llm (multiprocessing's "forkserver", started once per test worker,
without threads or a process group): a fresh interpreter per rank spent seconds in imports, most of a small
test. Each rank takes the test's environment and working directory. A rank's exception is re-raised in the
test with that rank's traceback; a rank that hangs or dies fails the test after `timeout` instead of
blocking CI.
"""

from __future__ import annotations

import functools
import importlib
import multiprocessing as mp
import os
import pickle
import socket
import traceback
from datetime import timedelta
from typing import Any, Callable

DEFAULT_TIMEOUT_S = 180.0
# imported once by the fork server, so that no rank pays for them (torch._dynamo: torch.optim's first use;
# DeepSpeed's engine imports its Muon optimizer, whose torch.compile at import loads torch._inductor: seconds in
# every rank of the many DeepSpeed tests). A module that does not import is skipped by the fork server.
PRELOAD = ["torch", "torch.distributed", "torch.distributed.checkpoint", "torch._dynamo", "matplotlib.pyplot",
           "dist_llm.train.trainer", "tests.test_data_parallel", "deepspeed",
           "deepspeed.runtime.zero.muon.muon_optimizer"]


class RankFailed(AssertionError):
    """A rank raised, died or timed out; the message carries its traceback."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _resolve(ref: tuple[str, str] | Callable[..., Any]) -> Callable[..., Any]:
    if callable(ref):
        return ref
    module, qualname = ref
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return getattr(obj, "__wrapped__", obj)  # the undecorated body of a @distributed test


def _rank_main(ref: Any, rank: int, world_size: int, port: int, init_group: bool, env: dict[str, str],
               cwd: str, args: tuple, kwargs: dict, queue: Any) -> None:
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": str(world_size), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # N ranks share the machine's cores; oversubscription only slows the suite
    try:
        if init_group:
            dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=120))
        result = _resolve(ref)(rank, world_size, *args, **kwargs)
        # plain pickle copies tensor data; the queue's own pickler would pass shared-memory handles that
        # die with this process
        queue.put((rank, True, pickle.dumps(result)))
    except BaseException:  # noqa: BLE001 - everything goes back to the test
        queue.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001
                pass


def run_distributed(fn: Callable[..., Any] | tuple[str, str], world_size: int, *args: Any,
                    timeout: float = DEFAULT_TIMEOUT_S, init_group: bool = True, env: dict[str, str] | None = None,
                    **kwargs: Any) -> list[Any]:
    """Run `fn(rank, world_size, *args, **kwargs)` on `world_size` processes; return the ranks' results in
    rank order. `fn` must be importable by name (a module-level function). With `init_group=False` the
    process group is left to `fn` (to test code that initialises it from the environment)."""
    try:
        return _run(fn, world_size, args, kwargs, timeout, init_group, env)
    except RankFailed as e:
        # the free port can be taken by a parallel test between our probe and the rendezvous: retry once
        if "Address already in use" not in str(e) and "EADDRINUSE" not in str(e):
            raise
        return _run(fn, world_size, args, kwargs, timeout, init_group, env)


def _run(fn: Callable[..., Any] | tuple[str, str], world_size: int, args: tuple, kwargs: dict, timeout: float,
         init_group: bool, env: dict[str, str] | None) -> list[Any]:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    queue = ctx.Queue()
    port = free_port()
    rank_env = {**os.environ, "MPLBACKEND": "Agg", **(env or {})}
    procs = [ctx.Process(target=_rank_main, args=(fn, r, world_size, port, init_group, rank_env, os.getcwd(), args,
                                                  kwargs, queue), daemon=True) for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    failures: list[str] = []
    timed_out = False
    try:
        import queue as queue_mod

        while len(results) + len(failures) < world_size:
            try:
                rank, ok, payload = queue.get(timeout=timeout)
            except queue_mod.Empty:
                timed_out = True
                dead = [r for r, p in enumerate(procs) if not p.is_alive() and p.exitcode not in (0, None)]
                raise RankFailed(f"timed out after {timeout:.0f}s waiting for ranks "
                                 f"{sorted(set(range(world_size)) - set(results))}"
                                 + (f"; ranks {dead} died" if dead else "")) from None
            if ok:
                results[rank] = pickle.loads(payload)
            else:
                failures.append(f"--- rank {rank} ---\n{payload}")
                break  # the other ranks are likely stuck in a collective with the failed one
        if failures:
            raise RankFailed("a rank failed:\n" + "\n".join(failures))
    finally:
        for p in procs:
            # a rank that failed or hung is not waited for: its peers are stuck with it (or it is the one stuck)
            p.join(timeout=0.5 if failures or timed_out else 5)
            if p.is_alive():
                p.kill()
                p.join()
    return [results[r] for r in range(world_size)]


def distributed(world_size: int, *, timeout: float = DEFAULT_TIMEOUT_S) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorate a test `def test_x(rank, world_size, **fixtures)`; pytest sees a test of the fixtures only."""

    def decorate(fn: Callable[..., Any]) -> Callable[..., Any]:
        ref = (fn.__module__, fn.__qualname__)

        @functools.wraps(fn)
        def wrapper(**kwargs: Any) -> None:
            run_distributed(ref, world_size, timeout=timeout, **kwargs)

        # pytest must not ask for `rank`/`world_size` fixtures: hide them from the visible signature
        import inspect

        sig = inspect.signature(fn)
        params = [p for name, p in sig.parameters.items() if name not in ("rank", "world_size")]
        wrapper.__signature__ = sig.replace(parameters=params)  # type: ignore[attr-defined]
        return wrapper

    return decorate
