"""What stops a training run, each with one line that names the cause."""


class TrainingError(RuntimeError):
    """Training cannot go on (e.g. too many non-finite steps in a row); the last good checkpoint is kept."""


class CheckpointError(TrainingError):
    """A checkpoint could not be written (disk full, an I/O error); the previous complete one is untouched."""


class CollectiveError(TrainingError):
    """A collective failed: a rank stuck past `parallel.timeout_s`, or a peer gone."""
