"""Pipeline parallelism (`parallel.pp` stages, `parallel.pp_schedule` gpipe or 1f1b).

  schedule.py   schedules as data: per stage, the ordered list of actions of one step (receive, forward, send,
                and their backward counterparts) for GPipe and 1F1B; `simulate` checks them without processes
                (each micro-batch forward then backward once per stage, no deadlock, the bubble)
  stage.py      which blocks each stage holds (balanced by parameter count, or `parallel.pp_layers`) and
                `cut_to_stage`, which keeps one stage's part of a built GPT under the whole model's names
  executor.py   runs any schedule on one stage: activations and their gradients go point to point to the
                neighbour stages in the compute dtype; it times the stage's compute (the bubble) and checks
                its stashes are empty at the end of a step

The trainer composes stages with tensor parallelism and with data parallelism at ZeRO stages 0-2 (the
native backend: FSDP2 and DeepSpeed expect to run the whole forward, so the config refuses them with pp > 1).
"""
