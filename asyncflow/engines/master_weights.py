"""float32 master copies of parameters that a model holds, and computes with, in a lower dtype.

Why: with `model.dtype: bfloat16` the trainer's passes run on bf16 weights (no autocast casting
float32 weights and activations at every op: 13% of a CPU train step), yet an AdamW update of ~lr
is far below half a bf16 rounding step of a typical weight, so updating the bf16 weights directly
loses most updates. Here the optimizer steps float32 masters: each parameter's bf16 gradient is added
into its master's float32 gradient as soon as backward has accumulated it (and then freed), and
`write_back` copies the stepped masters into the model's weights. The masters are taken from the
weights before the model is cast down, so a model loaded from a float32 checkpoint resumes exactly.
"""

from __future__ import annotations

import torch


class MasterWeights:
    """float32 masters of `params` (taken now, while the params still hold float32 values)."""

    def __init__(self, params: list[torch.nn.Parameter]) -> None:
        self.params = params
        self.masters = [torch.nn.Parameter(p.detach().to(torch.float32, copy=True)) for p in params]
        self._master_of = {id(p): m for p, m in zip(params, self.masters, strict=True)}
        for p in params:
            p.register_post_accumulate_grad_hook(self._take_grad)

    def _take_grad(self, param: torch.Tensor) -> None:
        """Move `param`'s gradient (just accumulated by backward) into its master's, in float32."""
        master = self._master_of[id(param)]
        assert param.grad is not None
        if master.grad is None:
            master.grad = param.grad.to(torch.float32)
        else:
            master.grad.add_(param.grad)
        param.grad = None

    @torch.no_grad()
    def write_back(self) -> None:
        """Copy the masters (after an optimizer step) into the model's weights, rounding to their dtype."""
        for p, m in zip(self.params, self.masters, strict=True):
            p.copy_(m)

    def state(self, names: dict[int, str]) -> dict[str, torch.Tensor]:
        """The masters by parameter name (`names`: id(param) -> its state-dict name)."""
        return {names[id(p)]: m.detach() for p, m in zip(self.params, self.masters, strict=True)}
