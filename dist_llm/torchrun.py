"""`python -m dist_llm.torchrun ARGS`: torchrun (torch.distributed.run, the same arguments), which
`dist-llm train --nproc-per-node N` starts, with its failure report cut to what the workers did not already say.

torchrun answers a worker's non-zero exit with a Python traceback of its own and a table of every rank's exit
(and logs each rank it stops). The workers have mostly said why already: bad input as one line from rank 0
(exit 2), a failed step or collective as one line, a crash as its traceback. So here the cause (a worker killed
by a signal other than the SIGTERM torchrun stops the others with and the SIGKILL it follows that with, else the
first that exited non-zero) ends the launcher with its code, and one line is added only where no worker said it:
  - a worker killed by a signal (the kernel's OOM killer, a segfault) could say nothing;
  - the cause's line that no rank printed (`cli.fail` prints on rank 0 only, unless every rank names itself, and
    leaves the line, whether it printed it, and when, in the worker's TORCHELASTIC_ERROR_FILE): a failure only
    rank k met, or rank 0 stopped by torchrun before it printed; without such a file, its rank and exit code.
A signal to the launcher itself (torchrun's SignalException) exits 128 + its number; any other failure of
torchrun (a rendezvous that cannot form) is one line."""

from __future__ import annotations

import logging
import os
import signal
import sys
from typing import Any, TextIO

# torchrun's own lines about a failure this module reports once (kept: any other, e.g. a worker that would not
# stop on SIGTERM and was killed)
_ITS_REPORT = ("Sending process", "failed (exitcode")
_ITS_KILL = "Unable to shutdown process"  # "... %s via SIGTERM, forcefully exiting via SIGKILL": its kill, not a cause


class _WithoutItsReport(logging.Filter):
    def __init__(self) -> None:
        super().__init__()
        self.killed: set[int] = set()  # the pids torchrun itself killed (a worker stuck where SIGTERM cannot act)

    def filter(self, record: logging.LogRecord) -> bool:
        if str(record.msg).startswith(_ITS_KILL) and record.args:
            self.killed.add(int(record.args[0]))  # type: ignore[index]
        return not str(record.msg).startswith(_ITS_REPORT)


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    its_report = _WithoutItsReport()
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(its_report)
    # what torchrun sets for its workers when it is unset, without its banner about it (one thread per worker:
    # N workers on N cores; OMP_NUM_THREADS set by the user is kept)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        run(parse_args(sys.argv[1:] if argv is None else argv))
    except ChildFailedError as e:
        return exit_code(e.failures, sys.stderr, killed_by_torchrun=its_report.killed)
    except SignalException as e:  # (a signal before dist-llm's launcher could pass it to workers)
        return 128 + int(e.sigval)
    except Exception as e:  # noqa: BLE001 - torchrun's own failure (rendezvous), not a worker's
        print(f"dist-llm: error: torchrun: {type(e).__name__}: {str(e).strip().splitlines()[0] if str(e) else ''}",
              file=sys.stderr)
        return 1
    return 0


def _left(failure: Any) -> dict[str, Any]:
    """What the worker's `cli.fail` left in its error file ({} without one: torchrun then fills in a stand-in)."""
    if not os.path.isfile(str(getattr(failure, "error_file", ""))):
        return {}
    data = failure.error_file_data
    return data if isinstance(data, dict) and isinstance(data.get("message"), str) and data["message"] else {}


def exit_code(failures: dict[int, Any], stderr: TextIO, *, killed_by_torchrun: set[int] = frozenset()) -> int:
    """What the launcher exits with for torchrun's failures {global rank: ProcessFailure}, saying only what no
    worker said (see the module's docstring)."""
    def when(rank_failure: tuple[int, Any]) -> tuple[float, int]:
        rank, failure = rank_failure
        return float(_left(failure).get("time", failure.timestamp)), rank

    by_time = sorted(failures.items(), key=when)
    killed = [(r, f) for r, f in by_time if f.exitcode < 0 and f.exitcode != -signal.SIGTERM
              and f.pid not in killed_by_torchrun]
    exited = [(r, f) for r, f in by_time if f.exitcode > 0]
    rank, failure = (killed or exited or by_time)[0]
    if failure.exitcode < 0:
        name = failure.signal_name()
        print(f"dist-llm: error: rank {rank} (pid {failure.pid}) was killed by {name}"
              f"{' (out of memory?)' if name == 'SIGKILL' else ''}; the other ranks were stopped", file=stderr)
        return 128 - failure.exitcode
    left = _left(failure)
    said = [_left(f) for _, f in by_time]
    if not left:
        # (a traceback, or a library's exit: where no rank printed a line of its own, its rank and code)
        if not any(s.get("printed") for s in said):
            print(f"dist-llm: error: rank {rank} (pid {failure.pid}) exited with code {failure.exitcode}",
                  file=stderr)
    elif not any(s.get("printed") and s["message"] == left["message"] for s in said):
        print(f"dist-llm: error: {left['message']}", file=stderr)
    return failure.exitcode


if __name__ == "__main__":
    sys.exit(main())
