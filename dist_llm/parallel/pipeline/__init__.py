"""Pipeline parallelism: schedules as data (schedule.py) and the split of blocks into stages (stage.py).

The executor that runs the schedules between processes is still to come; `parallel.pp` accepts only 1."""
