"""`python -m dist_llm.torchrun ARGS`: torchrun (torch.distributed.run, the same arguments), which
`dist-llm train --nproc-per-node N` starts, with its failure report cut to what the workers did not already say.

torchrun answers a worker's non-zero exit with a Python traceback of its own and a table of every rank's exit
(and logs each rank it stops). The workers have said why already: bad input as one line from rank 0 (exit 2),
a failed step or collective as one line, a crash as its traceback. So here a worker's exit code ends the
launcher with that code and nothing more; only a worker killed by a signal (the kernel's OOM killer, a
segfault), which could say nothing, gets one line naming its rank and the signal."""

from __future__ import annotations

import logging
import os
import sys


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    # (its "Sending process N closing signal SIGTERM" and "failed (exitcode: 2) local_rank: ..." lines: the
    # failure is reported below, once)
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").setLevel(logging.CRITICAL)
    # what torchrun sets for its workers when it is unset, without its banner about it (one thread per worker:
    # N workers on N cores; OMP_NUM_THREADS set by the user is kept)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        run(parse_args(sys.argv[1:] if argv is None else argv))
    except ChildFailedError as e:
        return exit_code(e, sys.stderr)
    return 0


def exit_code(error: object, stderr: object) -> int:
    """What the launcher exits with for torchrun's ChildFailedError `error` (its first failure), saying only what
    no worker could: a signal that killed one."""
    rank, failure = error.get_first_failure()  # type: ignore[attr-defined]
    if failure.exitcode > 0:
        return failure.exitcode
    name = failure.signal_name()
    print(f"dist-llm: error: rank {rank} (pid {failure.pid}) was killed by {name}"
          f"{' (out of memory?)' if name == 'SIGKILL' else ''}; the other ranks were stopped", file=stderr)
    return 128 - failure.exitcode


if __name__ == "__main__":
    sys.exit(main())
