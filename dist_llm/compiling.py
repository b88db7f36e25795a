"""`keep_out_of_graphs`: a function that train.compile's graphs call eagerly (a graph break around it), without
loading the compiler when the module that defines it is imported.

`torch.compiler.disable` imports torch._dynamo as it decorates (sympy and the tracer: ~2 s of a process's start on 2
CPU cores), so decorators at module level charged it to every process that imported dist_llm. torch's own lazy form
imports it at the wrapper's first call instead, and Dynamo skips the wrapper (torch._compile is on its skip list), so
under compile the call breaks the graph and runs the function with Dynamo off, as torch.compiler.disable does. It is
private, but torch itself uses it wherever an import cycle forbids the public one; where a build lacks it, the public
one. What gains: the commands that build no optimizer (sample, convert, memory, report, every refusal of a bad
config before the build). A training process still loads torch._dynamo when it builds its optimizer (torch.optim
wraps `add_param_group` the same lazy way). Under TORCH_LOGS=graph_breaks such a break names the wrapper in
torch/_compile.py as a skipped function, where torch.compiler.disable's said "disabled".
"""

from __future__ import annotations

from typing import Any, Callable, TypeVar

import torch

F = TypeVar("F", bound=Callable[..., Any])

_disable: Callable[[Callable[..., Any]], Callable[..., Any]] = getattr(torch, "_disable_dynamo", torch.compiler.disable)


def keep_out_of_graphs(fn: F) -> F:
    return _disable(fn)  # type: ignore[return-value]
