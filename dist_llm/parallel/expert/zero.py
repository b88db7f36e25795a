"""ZeRO-1/2 under expert parallelism: two ZeRO forms over one model.

The dense parameters (attention, router, dense and shared-expert MLPs, embeddings) shard over the whole dp
group as without experts; this rank's expert slices, which only the expert-dp group's ranks hold alike, go into
flat buffers of their own sharded over that group, their summed gradients divided by dp (grads.py says why).
The trainer drives the pair as one form: each step, clip, checkpoint and byte count covers both.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch
from torch import nn

from dist_llm.config import Config
from dist_llm.parallel.context import ParallelContext
from dist_llm.parallel.data.base import DataParallel, tensor_bytes
from dist_llm.parallel.data.zero import ZeroDataParallel, ZeroPart
from dist_llm.parallel.expert.grads import expert_parameters


class ExpertZeroDataParallel(DataParallel):
    dp_sharded_grads = True  # dense shards disjoint over dp; expert shards over expert-dp x ep = dp

    def __init__(self, model: nn.Module, cfg: Config, ctx: ParallelContext, *, stage: int,
                 draw: Callable[[str], None] | None = None) -> None:
        self.cfg, self.ctx, self.stage = cfg, ctx, stage
        self.name = f"zero{stage}+ep"
        self.module = self.model = model
        experts = frozenset(n for n, _ in expert_parameters(model))
        dense = frozenset(n for n, p in model.named_parameters() if p.requires_grad and n not in experts)
        parts = [ZeroPart(dense, ctx.dp_group, ctx.dp, ctx.dp_rank, ctx.dp),
                 ZeroPart(experts, ctx.expert_dp_group, ctx.expert_dp, ctx.dp_rank // ctx.ep, ctx.dp)]
        # A PEFT run may train no expert tensors (LoRA on attention alone, adapters) or nothing but them
        # (experts_* targets alone): a part with nothing to train gets no form (a ZeRO form needs parameters)
        self.owned = [(part.names, ZeroDataParallel(model, cfg, ctx, stage=stage, part=part, draw=draw))
                      for part in parts if part.names]
        self.forms = tuple(form for _, form in self.owned)
        # (a pipeline stage of dense blocks alone holds no experts, nor do its expert-dp peers: no expert form)
        self.dense = self.owned[0][1] if dense else None
        self.optimizer = self.forms[0].optimizer  # (the learning rate the trainer reads; all step alike)

    def micro_step(self, *, last: bool) -> contextlib.AbstractContextManager:
        stack = contextlib.ExitStack()
        for form in self.forms:
            stack.enter_context(form.micro_step(last=last))
        return stack

    def finish_grads(self) -> None:
        for form in self.forms:
            form.finish_grads()

    def grad_shards(self) -> list[tuple[nn.Parameter, torch.Tensor, int]]:
        return [s for form in self.forms for s in form.grad_shards()]

    def tied_embedding_grad(self) -> torch.Tensor:
        # the embedding is dense: its piece as the dense form holds it (ZeRO-2 keeps no whole .grad of it)
        return self.dense.tied_embedding_grad()

    def step(self, lr: float, found_inf: torch.Tensor) -> torch.Tensor | None:
        for form in self.forms:
            form.step(lr, found_inf)
        return None

    def zero_grad(self) -> None:
        for form in self.forms:
            form.zero_grad()

    def checkpoint_state(self) -> dict[str, Any]:
        states = [(names, form.checkpoint_state()) for names, form in self.owned]
        model = dict(states[0][1]["model"])  # (every form's dict holds the frozen tensors as the module's own)
        for names, state in states[1:]:  # each trained tensor from the form that holds it
            model.update({k: v for k, v in state["model"].items() if k in names})
        optim = {k: v for _, state in states for k, v in state["optim"]["state"].items()}
        return {"model": model, "optim": {"state": optim}}

    def load_checkpoint_state(self, state: dict[str, Any]) -> None:
        optim = state["optim"]["state"]
        for names, form in self.owned:
            form.load_checkpoint_state({"model": state["model"],
                                        "optim": {"state": {k: v for k, v in optim.items() if k in names}}})

    def model_state_bytes(self) -> dict[str, int]:
        each = [form.model_state_bytes() for form in self.forms]
        total = {k: sum(b[k] for b in each) for k in each[0]}  # (each holds its own buffers)
        total["params"] -= (len(each) - 1) * tensor_bytes(p for p in self.module.parameters() if not p.requires_grad)
        # (a PEFT run's frozen base, outside the forms' buffers: each counts it, the rank holds it once)
        return total
