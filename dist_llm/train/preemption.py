"""Stopping a run on a signal: SIGTERM (a scheduler's preemption, torchrun stopping the job) and Ctrl-C."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
from typing import Any, Iterator

# Seconds a second Ctrl-C leaves the process to unwind before it is ended outright (None: never). A process of
# its own sets it (`abort_within`): the KeyboardInterrupt lands wherever the main thread happens to be, and
# clean-up after it may wait on a lock or a thread the interrupt left mid-task; a user who pressed Ctrl-C twice
# wants the prompt back, whatever that clean-up does. A library caller keeps its process.
_abort_grace_s: float | None = None


def abort_within(seconds: float | None) -> None:
    global _abort_grace_s
    _abort_grace_s = seconds


# Set by a second Ctrl-C, the abort: a checkpoint write it stops can come out as the writer's own failure, and the
# KeyboardInterrupt behind it can be lost on the way (DCP shares each rank's failure pickled, without __context__)
_aborting = False


def interrupted(e: BaseException) -> bool:
    """Whether a failure is the abort a second Ctrl-C asked for: this process saw one, or a KeyboardInterrupt is in
    the failure's chain (a writer it stopped that then failed to close, torch.save's zip writer: "unexpected pos",
    the interrupt its context) or among the rank failures DCP wrapped."""
    if _aborting:
        return True
    from torch.distributed.checkpoint.api import CheckpointException

    stack: list[BaseException | None] = [e]
    seen: set[int] = set()
    while stack:
        x = stack.pop()
        if x is None or id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, KeyboardInterrupt):
            return True
        stack += [x.__context__, x.__cause__]
        if isinstance(x, CheckpointException):
            stack += [inner for inner, _ in x.failures.values()]
    return False


def _abort(code: int) -> None:
    sys.stderr.write("dist-llm: error: interrupted: clean-up after the second Ctrl-C did not finish; stopped\n")
    sys.stderr.flush()
    os._exit(code)


class Preemption:
    """SIGTERM or a first Ctrl-C (SIGINT) asks the run to stop: the step in flight finishes, a checkpoint is
    saved, and the process exits (0 after SIGTERM, 130 after Ctrl-C), ready for `train.resume=auto`. A second
    Ctrl-C aborts at once (KeyboardInterrupt, no save), and from then on SIGINT has its default action, so a
    third one ends the process even inside a blocking call."""

    def __init__(self) -> None:
        self.requested = False
        self.signal_name: str | None = None  # "SIGTERM" or "SIGINT": what asked the run to stop
        self._previous: dict[int, Any] = {}

    def install(self) -> Preemption:
        global _aborting
        _aborting = False  # (a run of its own: a library caller may train again after an abort)
        if threading.current_thread() is threading.main_thread():  # signals reach the main thread only
            self._previous[signal.SIGTERM] = signal.signal(signal.SIGTERM, self._handle)
            if signal.getsignal(signal.SIGINT) is not signal.SIG_IGN:  # (ignored when started in the background)
                self._previous[signal.SIGINT] = signal.signal(signal.SIGINT, self._handle)
        return self

    @property
    def code(self) -> int:
        """0: go on; 1: SIGTERM; 2: Ctrl-C (what the ranks agree on: the largest any of them saw)."""
        return {None: 0, "SIGTERM": 1, "SIGINT": 2}[self.signal_name]

    def _handle(self, signum: int, frame: Any) -> None:
        if signum == signal.SIGINT and self.signal_name == "SIGINT":
            global _aborting
            _aborting = True
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            if _abort_grace_s is not None:
                timer = threading.Timer(_abort_grace_s, _abort, args=(130,))
                timer.daemon = True
                timer.start()
            raise KeyboardInterrupt
        self.requested = True
        self.signal_name = self.signal_name or signal.Signals(signum).name

    def restore(self) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)
        self._previous = {}


class Terminated(BaseException):
    """A SIGTERM before training began (or after it ended): during the build, the data preparation, a load or a
    resume, when there is nothing to save. A BaseException, as KeyboardInterrupt is, so that the `except
    Exception` of code that reports its own failures does not take it for one; what it unwinds cleans up as
    after a Ctrl-C (the run lock released, files written whole or not at all)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _raise_terminated(signum: int, frame: Any) -> None:
    raise Terminated(signum)


@contextlib.contextmanager
def terminate_raises() -> Iterator[None]:
    """While inside, a SIGTERM raises `Terminated` (by default it would end the process at once, leaving the run
    lock and torchrun's failure report behind); `Preemption` takes over while training runs. A SIGTERM the
    parent set to be ignored stays ignored; only the main thread can install it."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGTERM) is signal.SIG_IGN:
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
