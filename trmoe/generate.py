"""Autoregressive decoding with a KV cache: greedy, temperature, top-k and top-p sampling.

One forward of the prompts fills the cache (prefill), then each step feeds only the newest token of every row
(trmoe.model.kv_cache). Prompts of different lengths are left-padded into one batch. Sampling draws from a
torch.Generator seeded by `seed`, so the same model, prompts and settings give the same tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from trmoe.errors import UserError
from trmoe.model.transformer import TRMoETransformer


@dataclass(frozen=True)
class Sampling:
    max_new_tokens: int = 64
    greedy: bool = False
    temperature: float = 1.0
    top_k: int = 0  # 0 = the whole vocabulary
    top_p: float = 1.0  # nucleus: the smallest set of tokens whose probability reaches top_p
    seed: int = 0

    def check(self) -> None:
        """UserError naming the first setting out of range."""
        if self.max_new_tokens < 0:
            raise UserError(f"max_new_tokens={self.max_new_tokens}: allowed: 0 or more")
        if self.temperature <= 0 and not self.greedy:
            raise UserError(f"temperature={self.temperature}: allowed: > 0 (or greedy decoding)")
        if self.top_k < 0:
            raise UserError(f"top_k={self.top_k}: allowed: 0 (off) or more")
        if not 0 < self.top_p <= 1:
            raise UserError(f"top_p={self.top_p}: allowed: 0 < top_p <= 1")


def next_token(logits: torch.Tensor, s: Sampling, generator: torch.Generator | None) -> torch.Tensor:
    """logits [B, V] (fp32) -> the next token id of each row [B]."""
    if s.greedy:
        return logits.argmax(-1)
    logits = logits / s.temperature
    if 0 < s.top_k < logits.shape[-1]:
        kth = logits.topk(s.top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if s.top_p < 1:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        # drop a token when the ones before it already reach top_p (the first always stays)
        drop = probs.cumsum(-1) - probs >= s.top_p
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    return torch.multinomial(logits.softmax(-1), 1, generator=generator).squeeze(-1)


@torch.no_grad()
def generate(
    model: TRMoETransformer,
    prompts: list[list[int]],
    s: Sampling,
    *,
    eos_id: int | None = None,
    done: Callable[[int, list[int]], bool] | None = None,
) -> list[list[int]]:
    """The new tokens of each prompt (without the prompt): up to s.max_new_tokens, ending after eos_id or
    when `done(row, new_tokens)` says so (stop strings)."""
    s.check()
    model.refuse_analysis_only("sampling")
    if not prompts or any(len(p) == 0 for p in prompts):
        raise UserError("prompt: empty; allowed: at least one token")
    limit = model.spec.max_seq_len
    longest = max(len(p) for p in prompts)
    if longest > limit:  # the prompt alone does not fit: no max_new_tokens would help
        raise UserError(
            f"prompt: {longest} tokens, longer than the model's max_seq_len={limit}; allowed: prompt tokens "
            f"+ max_new_tokens <= {limit}"
        )
    if longest + s.max_new_tokens > limit:
        raise UserError(
            f"max_new_tokens={s.max_new_tokens}: with a prompt of {longest} tokens it passes the model's "
            f"max_seq_len={limit}; allowed: at most {max(limit - longest, 0)}"
        )
    device = model.embed.weight.device
    batch = len(prompts)
    pad = torch.tensor([longest - len(p) for p in prompts], device=device)
    filler = 0 if eos_id is None else eos_id  # any valid id: padding positions are never attended to
    ids = torch.tensor([[filler] * (longest - len(p)) + list(p) for p in prompts], device=device)
    out: list[list[int]] = [[] for _ in range(batch)]
    if s.max_new_tokens == 0:
        return out
    generator = None
    if not s.greedy:
        generator = torch.Generator(device=device).manual_seed(s.seed)
    cache = model.new_cache(batch, longest + s.max_new_tokens, pad)
    finished = [False] * batch
    hidden = model(ids, cache)[:, -1]
    for i in range(s.max_new_tokens):
        token = next_token(model.logits(hidden).float(), s, generator)
        for row, t in enumerate(token.tolist()):
            if finished[row]:
                continue
            out[row].append(t)
            if t == eos_id or (done is not None and done(row, out[row])):
                finished[row] = True
        if all(finished) or i == s.max_new_tokens - 1:
            break
        hidden = model(token.unsqueeze(1), cache)[:, -1]
    return out
