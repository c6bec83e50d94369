"""Operators of the `altup_cupy` namespace registered straight with PyTorch's dispatcher.

`torch.library.custom_op` wraps every call in Python layers of its own (its device-type dispatch,
argument checks) before the implementation runs; a `torch.library.Library` registration of the
same function skips them (`python -m altup_cupy.lab.op_registration` measures both, with and
without autograd; results/nvidia-h200/op_registration.csv). The Gemma 3n steps run four operators
per decoder layer, so at small batch the host, not the GPU, sets the pace. Registered this way, an
operator is one schema, one implementation for the CPU and CUDA dispatch keys, and a fake
implementation for torch.compile; `torch.library.register_autograd` makes it differentiable as it
would a custom_op."""

from __future__ import annotations

from typing import Callable

import torch

NAMESPACE = "altup_cupy"
_LIBRARY = torch.library.Library(NAMESPACE, "FRAGMENT")


class Operator:
    """torch.ops.altup_cupy.<name>, defined by `schema` and implemented by `impl` on CPU and CUDA
    tensors (impl branches on the device itself)."""

    def __init__(self, schema: str, impl: Callable):
        self.name = schema.split("(", 1)[0]
        self.qualname = f"{NAMESPACE}::{self.name}"
        _LIBRARY.define(schema)
        for dispatch_key in ("CPU", "CUDA"):
            _LIBRARY.impl(self.name, impl, dispatch_key)

    def register_fake(self, fake: Callable) -> Callable:
        """The shape-only implementation torch.compile and FakeTensorMode run."""
        torch.library.register_fake(self.qualname, fake, lib=_LIBRARY)
        return fake


def operator(schema: str) -> Callable[[Callable], Operator]:
    """Decorator: `@operator("predict(Tensor x, ...) -> Tensor")` over the implementation."""
    return lambda impl: Operator(schema, impl)
