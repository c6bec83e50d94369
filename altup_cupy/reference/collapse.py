"""The collapse forward (docs/SPEC.md section 1) in plain PyTorch."""

from __future__ import annotations

from typing import Sequence

import torch


def collapse_reference(
    hidden_states: torch.Tensor,
    unembed_projs: Sequence[torch.Tensor] | torch.Tensor,
    eps: float = 1e-5,
    dtype: torch.dtype = torch.float64,
) -> torch.Tensor:
    """out[t] = (s0 + sum_k y_k * rms(s0) / sqrt(max(mean(y_k^2), eps))) / N, in `dtype`.

    hidden_states [N, B, S, H]; unembed_projs N-1 matrices [H, H] (y = x @ W^T). The result is
    returned in `dtype`, not rounded to bf16.
    """
    streams = hidden_states.shape[0]
    x = hidden_states.to(dtype)
    s0 = x[0]
    target = s0.square().mean(dim=-1, keepdim=True).sqrt()
    total = s0.clone()
    for k in range(1, streams):
        y = x[k] @ unembed_projs[k - 1].to(dtype).T
        magnitude = y.square().mean(dim=-1, keepdim=True).clamp_min(eps).sqrt()
        total += y * (target / magnitude)
    return total / streams
