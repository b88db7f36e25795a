"""A stage's backward in two halves, for zero-bubble schedules: B, the gradient of the stage's input (which the
previous stage waits for), and W, the weight gradients (which nobody waits for, so they can run later).

Autograd computes both in one pass. To split it, B walks the graph once and finds the nodes on the input's
gradient path from which a weight gradient branches off (a linear layer's matmul backward, whose outputs are
the gradient of its input and, through the transpose, of its weight). B runs `torch.autograd.grad` to the stage
input alone (keeping the graph), with a pre-hook on each such node recording the gradient that reached it,
complete by then. W starts a backward at each of those nodes from the recorded gradient, with the parameters
behind its branch as `inputs`: autograd then runs only the branch (the weight matmul), not the input path
again, and accumulates into `.grad` through the parameters' AccumulateGrad nodes, so the data-parallel forms'
post-accumulate hooks fire as in an ordinary backward. The sum is the one backward's, up to the order of
floating-point additions into `.grad` (the same terms).

Under non-reentrant activation checkpointing W's branches run in one `GraphExecGroup` (torch 2.10 and later), so
that W recomputes each checkpointed region once, not once per branch point in it (B, a backward of its own,
recomputes it once too); without the group, once per branch point, the same gradients.

Where a parameter is reached both from a branch and from further down the input path (a weight used by two
layers of the stage), starting at the branch would also run the input path below it; such a graph is not
split: W then runs the whole backward, B nothing but that backward's input gradient (correct, not faster).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import torch.utils.checkpoint
from torch.autograd.graph import GradientEdge, Node

# GraphExecGroup is recent (torch 2.10); pyproject allows older builds, where W runs each branch's backward on its
# own: the same gradients, a checkpointed block recomputed once per weight op instead of once.
_GraphExecGroup = getattr(torch.utils.checkpoint, "GraphExecGroup", None)


@dataclass
class WeightWork:
    """What a B leaves for its W: (node, gradients that reached it, parameters behind its branch) per branch
    point, or the whole backward (`root`, `grad`) where the graph was not split. Holding it keeps the graph."""

    branches: list[tuple[Node, tuple[torch.Tensor | None, ...], list[torch.Tensor]]] = field(default_factory=list)
    root: torch.Tensor | None = None
    grad: torch.Tensor | None = None
    params: list[torch.Tensor] = field(default_factory=list)


def _walk(root: Node, inp: torch.Tensor | None,
          params: dict[int, torch.Tensor]) -> tuple[list[Node], dict[Node, bool], dict[Node, frozenset[int]]]:
    """The graph's nodes children first, whether each reaches the stage input, and the parameters it reaches."""
    order: list[Node] = []
    seen: set[Node] = set()
    stack: list[tuple[Node, bool]] = [(root, False)]
    while stack:  # iterative post-order: a stage's graph is thousands of nodes deep
        node, expanded = stack.pop()
        if expanded:
            order.append(node)
            continue
        if node in seen:
            continue
        seen.add(node)
        stack.append((node, True))
        stack += [(child, False) for child, _ in node.next_functions if child is not None and child not in seen]
    to_input: dict[Node, bool] = {}
    to_params: dict[Node, frozenset[int]] = {}
    for node in order:
        var = getattr(node, "variable", None)  # an AccumulateGrad node: a leaf tensor
        if var is not None:
            to_input[node] = inp is not None and var is inp
            to_params[node] = frozenset([id(var)]) if id(var) in params else frozenset()
            continue
        kids = [c for c, _ in node.next_functions if c is not None]
        to_input[node] = any(to_input[c] for c in kids)
        to_params[node] = frozenset().union(*(to_params[c] for c in kids))
    return order, to_input, to_params


def backward_input(root: torch.Tensor, grad: torch.Tensor | None, inp: torch.Tensor | None,
                   params: list[torch.Tensor]) -> tuple[torch.Tensor | None, WeightWork]:
    """B: the gradient of `inp` (None on the first stage, whose input is token ids) from `root` (the stage's
    output with its gradient `grad`, or the last stage's loss with None), and the work its W will do."""
    by_id = {id(p): p for p in params if p.requires_grad}
    if inp is None or root.grad_fn is None:
        return None, WeightWork(root=root, grad=grad, params=list(by_id.values()))
    order, to_input, to_params = _walk(root.grad_fn, inp, by_id)
    branch_points: list[tuple[Node, list[torch.Tensor]]] = []
    for node in order:
        if not to_input[node] or getattr(node, "variable", None) is not None:
            continue
        kids = [c for c, _ in node.next_functions if c is not None]
        behind = frozenset().union(*(to_params[c] for c in kids if not to_input[c]))
        if not behind:
            continue
        if behind & frozenset().union(*(to_params[c] for c in kids if to_input[c])):  # see the module docstring
            (d_inp,) = torch.autograd.grad(root, inp, grad, retain_graph=True)
            return d_inp, WeightWork(root=root, grad=grad, params=list(by_id.values()))
        branch_points.append((node, [by_id[i] for i in sorted(behind)]))
    reached: dict[Node, tuple[torch.Tensor | None, ...]] = {}
    hooks = [node.register_prehook(lambda grads, node=node: reached.__setitem__(node, grads))
             for node, _ in branch_points]
    try:
        (d_inp,) = torch.autograd.grad(root, inp, grad, retain_graph=True)
    finally:
        for h in hooks:
            h.remove()
    return d_inp, WeightWork(branches=[(node, reached[node], ps) for node, ps in branch_points if node in reached])


def backward_weights(work: WeightWork) -> None:
    """W: accumulate the weight gradients B left into `.grad` (through AccumulateGrad, so hooks fire)."""
    if work.root is not None:
        if work.params:
            torch.autograd.backward(work.root, work.grad, inputs=work.params)
        return
    # One group for all the branches: under non-reentrant activation checkpointing each backward recomputes the
    # regions whose saved tensors it reads, so a backward per branch recomputed a block once per weight of it;
    # in one group, once. The group requires the branches to read disjoint saved tensors (a checkpointed tensor
    # unpacked by two of them raises CheckpointError); the layers here (linear, norms, embeddings, routers) do.
    # Branches are taken output side first (B found them input side first) and dropped as they run: a region's
    # recomputed tensors are then freed once its last branch has read them, rather than all held to W's end.
    with _GraphExecGroup() if _GraphExecGroup is not None else contextlib.nullcontext():
        while work.branches:
            node, grads, params = work.branches.pop()
            edges = [(GradientEdge(node, i), g) for i, g in enumerate(grads) if g is not None]
            if edges:
                # retain_graph: another branch point may share a node below it (a transpose, a cast)
                torch.autograd.backward([e for e, _ in edges], [g for _, g in edges], inputs=params,
                                        retain_graph=True)
