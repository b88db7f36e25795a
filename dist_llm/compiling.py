"""`keep_out_of_graphs`: a function that train.compile's graphs call eagerly (a graph break around it), without
loading the compiler when the module that defines it is imported.

`torch.compiler.disable` imports torch._dynamo as it decorates (sympy and the tracer: ~1.7 s of a process's start on
2 CPU cores), so decorators at module level charged it to every process, compiling or not (train.compile is off by
default, and torchrun starts one process per rank). torch's own lazy form imports it at the wrapper's first call
instead, and Dynamo skips the wrapper (torch._compile is on its skip list), so under compile the call breaks the
graph and runs the function with Dynamo off, as torch.compiler.disable does. It is private but what torch itself
uses wherever an import cycle forbids the public one; where a build lacks it, the public one.
"""

from __future__ import annotations

from typing import Any, Callable, TypeVar

import torch

F = TypeVar("F", bound=Callable[..., Any])

keep_out_of_graphs: Callable[[F], F] = getattr(torch, "_disable_dynamo", torch.compiler.disable)
