"""StoSignSGD: sign descent with an unbiased stochastic sign (Yu, Pan, Liu, Zhang 2026, arXiv:2604.15416).

Plain signSGD steps by sign(m), which throws the magnitude of m away and is biased; on non-smooth
objectives (ReLU-like units, mixture-of-experts) it can fail to converge. StoSignSGD keeps one bit
per coordinate but draws it at random so that its expectation is proportional to m itself:

    m <- beta * m + (1 - beta) * g                        momentum (g: the data-parallel averaged gradient)
    G <- max(d * G, |m|)                                  per-coordinate scale, so that |m| <= G
    n ~ Uniform[-1, 1], independent per coordinate
    u  = sign(m + G * n)                                  P(u = +1) = (1 + m / G) / 2, so E[u] = m / G
    w <- w * (1 - lr * wd) - lr * u

d = 1 makes G the running maximum of |m|; d < 1 lets it forget old peaks. Where G = 0 (m = 0 so
far) the update is 0.

The noise is a pure function of (seed, step, parameter index): every data-parallel rank draws the same
numbers and so applies the same update with no communication, and a run resumed from its optimizer
state_dict (which holds the step) continues with the same draws. Under FSDP (a sharded DTensor parameter)
each rank draws the parameter's whole noise, as one process would, and keeps the part of its own shard: the
update is the single-process one, at the cost of one transient full-size noise tensor per parameter.
"""

from __future__ import annotations

import torch

from trmoe.runtime.parallel import is_dtensor, shard_region


def _noise_seed(seed: int, step: int, index: int) -> int:
    # a fixed mix of the three integers into 63 bits (any injective-enough map works; this one is stable)
    return (seed * 1_000_003 + step * 7_919 + index * 104_729 + 0x5DEECE66D) % (2**63 - 1)


class StoSignSGD(torch.optim.Optimizer):
    """Group keys: lr, beta (momentum), max_decay (d), weight_decay. `seed` salts the sign noise."""

    def __init__(self, params, lr: float = 1e-3, beta: float = 0.9, max_decay: float = 1.0,
                 weight_decay: float = 0.0, seed: int = 0):  # fmt: skip
        super().__init__(params, dict(lr=lr, beta=beta, max_decay=max_decay, weight_decay=weight_decay))
        self.seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}

    def _generator(self, device: torch.device) -> torch.Generator:
        if device not in self._generators:
            self._generators[device] = torch.Generator(device=device)
        return self._generators[device]

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        index = 0  # position of the parameter over all groups: part of its noise seed
        for group in self.param_groups:
            beta, d, lr, wd = group["beta"], group["max_decay"], group["lr"], group["weight_decay"]
            for p in group["params"]:
                index += 1
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p)
                    state["max_scale"] = torch.zeros_like(p)
                state["step"] += 1
                m, scale, grad, w = state["exp_avg"], state["max_scale"], p.grad, p
                gen = self._generator(p.device)
                gen.manual_seed(_noise_seed(self.seed, state["step"], index))
                noise = torch.rand(p.shape, generator=gen, device=p.device, dtype=p.dtype)  # global shape
                if is_dtensor(p):
                    # FSDP: this rank's part of the whole noise (the draws of one process); the rest is
                    # elementwise, on the local shards (views: updating them in place updates the DTensors)
                    noise = noise[shard_region(p)]
                    m, scale, grad, w = m.to_local(), scale.to_local(), grad.to_local(), p.to_local()
                m.lerp_(grad, 1.0 - beta)
                if d != 1.0:
                    scale.mul_(d)
                torch.maximum(scale, m.abs(), out=scale)
                noise.mul_(2.0).sub_(1.0)
                update = torch.sign(noise.mul_(scale).add_(m))  # sign(m + G n)
                if wd != 0.0:
                    w.mul_(1.0 - lr * wd)
                w.add_(update, alpha=-lr)
        return loss
