"""What stops a training run, each with one line that names the cause."""


class TrainingError(RuntimeError):
    """Training cannot go on (e.g. too many non-finite steps in a row); the last good checkpoint is kept."""


class CheckpointError(TrainingError):
    """A checkpoint could not be written (disk full, an I/O error); the previous complete one is untouched."""


class CollectiveError(TrainingError):
    """A collective failed: a rank stuck past `parallel.timeout_s`, or a peer gone."""


class ReadError(TrainingError):
    """Reading an input (model.init_from) failed in the operating system (an I/O error) or for a reason that is no
    fault of the input (a bug): exit 1, not 2, which says the input itself is bad."""
