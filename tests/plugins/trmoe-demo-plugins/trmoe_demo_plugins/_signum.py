"""The Signum update as a torch optimizer (imported by optimizer.py's builder only)."""

from __future__ import annotations

import torch


class Signum(torch.optim.Optimizer):
    def __init__(self, params, lr: float, momentum: float):
        super().__init__(params, {"lr": lr, "momentum": momentum})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            lr, beta, wd = group["lr"], group["momentum"], group.get("weight_decay", 0.0)
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["momentum"] = torch.zeros_like(p)
                m = state["momentum"]
                m.mul_(beta).add_(p.grad, alpha=1 - beta)
                if wd:
                    p.mul_(1 - lr * wd)
                p.add_(m.sign(), alpha=-lr)
