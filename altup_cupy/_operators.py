"""Operators of the `altup_cupy` namespace registered straight with PyTorch's dispatcher.

`torch.library.custom_op` wraps every call in Python layers of its own (its device-type dispatch,
argument checks) before the implementation runs; a `torch.library.Library` registration of the
same function skips them (`python -m altup_cupy.lab.op_registration` measures both, with and
without autograd; results/nvidia-h200/op_registration.csv). The Gemma 3n steps run four operators
per decoder layer, so at small batch the host, not the GPU, sets the pace. Registered this way, an
operator is one schema, one implementation for the CPU and CUDA dispatch keys, and a fake
implementation for torch.compile.

`Operator.register_autograd` makes it differentiable with torch's own autograd kernel
(`torch.library.register_autograd`'s), behind two shortcuts for calls on plain CPU or CUDA
tensors, where that kernel's Python layers (a dataclass per call, the schema's defaults filled
in, a second dispatch) cost more than the dispatcher call itself (the `Library` and `Operator` rows
of op_registration.csv):
- a call that records no gradient (a compiled graph's calls, inference, no_grad) goes straight to
  the implementation;
- a call that records one, of an operator without tensor-list arguments (the per-layer predict
  and correct), goes through a plain `torch.autograd.Function` around the implementation, with the
  same setup_context and backward.
Anything else (tensor lists, fake, functional or otherwise wrapped tensors: torch.compile's
tracing) takes torch's kernel.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch._library import autograd as library_autograd
from torch._library import utils as library_utils

NAMESPACE = "altup_cupy"
_LIBRARY = torch.library.Library(NAMESPACE, "FRAGMENT")
# The dispatch keys whose kernel is the implementation itself: after the autograd keys, a plain
# tensor's key set holds only its backend; a fake, functional or otherwise wrapped tensor, or a
# dispatch mode, adds keys of higher priority (Python, Functionalize, ...) that must see the call.
_PLAIN_BACKENDS = (torch._C.DispatchKey.CPU, torch._C.DispatchKey.CUDA)
_AFTER_AUTOGRAD = torch._C._after_autograd_keyset


class Operator:
    """torch.ops.altup_cupy.<name>, defined by `schema` and implemented by `impl` on CPU and CUDA
    tensors (impl branches on the device itself). `library`: another namespace's (the registration
    cost probes of altup_cupy.lab.op_registration)."""

    def __init__(self, schema: str, impl: Callable, library: torch.library.Library = _LIBRARY):
        self.name = schema.split("(", 1)[0]
        self.namespace = library.ns
        self.qualname = f"{self.namespace}::{self.name}"
        self.impl = impl
        self._library = library
        library.define(schema)
        for dispatch_key in ("CPU", "CUDA"):
            library.impl(self.name, impl, dispatch_key)

    def register_fake(self, fake: Callable) -> Callable:
        """The shape-only implementation torch.compile and FakeTensorMode run."""
        torch.library.register_fake(self.qualname, fake, lib=self._library)
        return fake

    def register_autograd(self, backward: Callable, setup_context: Callable) -> None:
        """Differentiable as `torch.library.register_autograd(qualname, backward,
        setup_context=setup_context)` makes it, with the shortcuts of the module docstring."""
        overload = getattr(getattr(torch.ops, self.namespace), self.name).default
        recording = library_autograd.make_autograd_impl(overload, library_autograd.Info(backward, setup_context))
        schema = overload._schema
        flat = not any(library_utils.is_tensorlist_like_type(a.type) for a in (*schema.arguments, *schema.returns))
        node = _plain_node(self.impl, backward, setup_context) if flat else None

        def autograd_kernel(keyset, *args, **kwargs):
            if (keyset & _AFTER_AUTOGRAD).highestPriorityTypeId() in _PLAIN_BACKENDS:
                if not (torch.is_grad_enabled() and torch._C._any_requires_grad(*args)):
                    return self.impl(*args, **kwargs)
                if node is not None and not kwargs:
                    return node.apply(*args)
            return recording(keyset, *args, **kwargs)

        self._library.impl(self.name, autograd_kernel, "Autograd", with_keyset=True)


def _plain_node(impl: Callable, backward: Callable, setup_context: Callable) -> type:
    """An autograd.Function whose forward runs `impl` and `setup_context(ctx, inputs, output)`,
    and whose backward is `backward`: what torch's kernel builds, without its per-call layers."""

    def forward(ctx, *args):
        with torch._C._AutoDispatchBelowAutograd():
            output = impl(*args)
        setup_context(ctx, args, output)
        return output

    return type(f"{getattr(impl, '__name__', 'operator')}_node", (torch.autograd.Function,),
                {"forward": staticmethod(forward), "backward": staticmethod(backward)})


def operator(schema: str) -> Callable[[Callable], Operator]:
    """Decorator: `@operator("predict(Tensor x, ...) -> Tensor")` over the implementation."""
    return lambda impl: Operator(schema, impl)
