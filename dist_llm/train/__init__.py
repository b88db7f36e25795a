"""Training: the trainer, optimizer and schedule, precision, checkpoints, metrics."""
