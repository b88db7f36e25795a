"""Pipeline parallelism (`parallel.pp` stages, `parallel.pp_schedule` gpipe, 1f1b, zb1 or interleaved).

  schedule.py   schedules as data: per stage, the ordered list of actions of one step (receive, forward, send,
                and their backward counterparts) for GPipe, 1F1B, ZB-H1 (backward split into B and W) and
                interleaved 1F1B (`parallel.pp_virtual` chunks per stage); `simulate` checks them without
                processes (each micro-batch forward then backward once per stage, no deadlock, the bubble)
  stage.py      which blocks each stage holds (balanced by training FLOPs, or `parallel.pp_layers`; interleaved:
                pp * pp_virtual runs, rank r holding runs r, r + pp, ...) and `cut_to_stage`, which keeps one
                stage's part of a built GPT under the whole model's names
  split_backward.py  ZB-H1's B (input gradient, autograd.grad to the stage input) and W (weight gradients,
                from the graph B kept) for one micro-batch
  executor.py   runs any schedule on one stage (or its chunks): activations and their gradients go point to
                point to the neighbour stages (round a ring under interleaved) in the compute dtype; it times
                the stage's compute (the bubble) and checks its stashes are empty at the end of a step

The trainer composes stages with tensor parallelism and with data parallelism at ZeRO stages 0-3 (the native
backend; FSDP2 per stage, driven from parallel/data/fsdp.py; DeepSpeed's engine expects to run the whole forward,
so the config refuses it with pp > 1).
"""
