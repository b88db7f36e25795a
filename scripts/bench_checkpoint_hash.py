"""Checkpoint checksums at 1, 2, 4 ranks: rank 0 hashing every file (before) against each rank hashing its own
files and verifying a share of them (now, `dist_llm.train.checksums`).

    python scripts/bench_checkpoint_hash.py [--gb 1] [--ranks 1 2 4] [--rounds 3] [--dir DIR] [--json PATH]

For each rank count, gloo processes on this machine hold `--gb` GB of tensors between them (64 MiB each,
spread evenly: each rank holds distinct ones, as ZeRO/FSDP shards are), and `--rounds` times:
  save    `dcp.save` of every rank's tensors, then the manifest's checksums. Before: a barrier, rank 0 hashes
          every file while the others wait, writes the manifest, a barrier. Now: each rank hashes the files it
          wrote, the {file: sha256} dicts are gathered to rank 0, which writes the manifest.
  verify  the check resume runs. Before: rank 0 reads and hashes every file, the others wait at a barrier.
          Now: each rank checks its share (balanced by bytes), the verdicts are all-gathered.
Seconds on rank 0, from a barrier to the point where every rank may go on; medians over the rounds. The files
are read back from the page cache (they were just written), so hashing runs at sha256's speed on one core
per rank: the figures measure how the work is spread, not the disk. Parallel hashing needs free cores: on a
machine with fewer idle cores than ranks the times cannot show it, so the table also gives the most bytes
one rank hashed (the critical path, whatever the machine), counted by wrapping `checksums.sha256_file`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from dist_llm.train import checksums  # noqa: E402

CHUNK = 64 << 20  # bytes per tensor


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


HASHED = [0]  # bytes this rank hashed in the phase being timed


def counting_sha256(path: Path, real=checksums.sha256_file) -> str:  # type: ignore[no-untyped-def]
    HASHED[0] += path.stat().st_size
    return real(path)


def timed(fn) -> tuple[float, int]:  # type: ignore[no-untyped-def]
    """Seconds from a barrier to fn's return on this rank, and the most bytes one rank hashed meanwhile."""
    dist.barrier()
    HASHED[0] = 0
    start = time.perf_counter()
    fn()
    seconds = time.perf_counter() - start
    most = torch.tensor(HASHED[0])
    dist.all_reduce(most, op=dist.ReduceOp.MAX)
    return seconds, int(most)


def write_manifest(path: Path, files: checksums.FileEntries) -> None:
    (path / checksums.MANIFEST).write_text(json.dumps({"files": files}))


def save_before(state: dict, path: Path) -> None:
    dcp.save(state, checkpoint_id=str(path))
    dist.barrier()
    if dist.get_rank() == 0:  # what `_complete` did: the main rank hashed everything
        write_manifest(path, checksums.hash_files(path, checksums.checkpoint_files(path)))
    dist.barrier()


def save_now(state: dict, path: Path) -> None:
    dcp.save(state, checkpoint_id=str(path))
    checksums.hash_and_write_manifest(path, rank=dist.get_rank(), group=None,
                                      write=lambda files: write_manifest(path, files))


def verify_before(path: Path) -> None:
    if dist.get_rank() == 0:
        files = checksums.read_manifest(path)
        assert not isinstance(files, str) and checksums.check_files(path, files) is None
    dist.barrier()


def verify_now(path: Path) -> None:
    assert checksums.verify(path) is None


def rank_main(rank: int, world: int, port: int, total_bytes: int, rounds: int, workdir: str,
              queue: Any) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    checksums.sha256_file = counting_sha256
    dist.init_process_group("gloo", rank=rank, world_size=world)
    n = total_bytes // CHUNK
    gen = torch.Generator().manual_seed(rank)
    state = {"model": {f"t{i:04d}": torch.randint(0, 256, (CHUNK,), dtype=torch.uint8, generator=gen)
                       for i in range(rank, n, world)}}
    times: dict[str, list[float]] = {k: [] for k in ("save before", "save now", "verify before", "verify now")}
    hashed: dict[str, int] = {}
    for r in range(rounds):
        ways = [("before", save_before, verify_before), ("now", save_now, verify_now)]
        for way, save, verify in ways if r % 2 == 0 else ways[::-1]:  # each goes first in turn (warm caches)
            path = Path(workdir) / f"w{world}-r{r}-{way}"
            for phase, fn in (("save", lambda: save(state, path)), ("verify", lambda: verify(path))):
                seconds, hashed[f"{phase} {way}"] = timed(fn)
                times[f"{phase} {way}"].append(seconds)
            dist.barrier()
            if rank == 0:
                shutil.rmtree(path)
    if rank == 0:
        queue.put({**{k: statistics.median(v) for k, v in times.items()},
                   **{f"GB by one rank, {k}": v / 1e9 for k, v in hashed.items()}})
    dist.destroy_process_group()


def bench(world: int, total_bytes: int, rounds: int, workdir: Path) -> dict[str, float]:
    ctx = mp.get_context("spawn")
    queue, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=rank_main, args=(r, world, port, total_bytes, rounds, str(workdir), queue),
                         daemon=True) for r in range(world)]  # (daemons: they go when this script stops)
    for p in procs:
        p.start()
    result = queue.get(timeout=3600)
    for p in procs:
        p.join()
        if p.exitcode != 0:
            raise SystemExit(f"rank exited with {p.exitcode}")
    return result



def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, default=1.0, help="checkpoint size in GB (10^9 bytes)")
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=None,
                        help="where the checkpoints are written (default: a temp dir)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    total = int(args.gb * 1e9) // CHUNK * CHUNK
    workdir = Path(tempfile.mkdtemp(prefix="bench_ckpt_hash_", dir=args.dir))
    rows = {}
    try:
        for world in args.ranks:
            rows[world] = bench(world, total, args.rounds, workdir)
            print(f"ranks {world}: " + ", ".join(f"{k} {v:.2f}" for k, v in rows[world].items()), flush=True)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print(f"\ncheckpoint {total / 1e9:.2f} GB, {os.cpu_count()} cores, medians of {args.rounds} rounds (seconds)\n")
    print("| ranks | save before | save now | verify before | verify now | save + verify before | now | "
          "GB one rank hashes, save + verify: before | now |")
    print("|---|---|---|---|---|---|---|---|---|")
    for world, t in rows.items():
        before, now = t["save before"] + t["verify before"], t["save now"] + t["verify now"]
        gb = [t[f"GB by one rank, save {w}"] + t[f"GB by one rank, verify {w}"] for w in ("before", "now")]
        print(f"| {world} | {t['save before']:.2f} | {t['save now']:.2f} | {t['verify before']:.2f} | "
              f"{t['verify now']:.2f} | {before:.2f} | {now:.2f} | {gb[0]:.2f} | {gb[1]:.2f} |")
    if args.json:
        args.json.write_text(json.dumps({"bytes": total, "rounds": args.rounds, "results": rows}, indent=1))


if __name__ == "__main__":
    main()
