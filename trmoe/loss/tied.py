"""Exact cross-entropy over the full vocabulary for a head tied to the token embedding.

The output head of the model is the token embedding W [V, H] itself, so the logits of a token
with final hidden state h are z = h @ W.T. With V ~ 200k, the full [N, V] logits of a batch
would be huge, so `chunked_tied_ce` walks over the tokens in chunks of `chunk_tokens` rows and
never materialises more than one [chunk, V] block of logits.

When gradients are needed, each chunk's gradient is computed right away in the forward pass
(the softmax is already in hand there), so every chunk costs exactly 3 GEMMs:

    logits = h_c @ W.T        [n, V]   forward
    dh_c   = g @ W            [n, H]   gradient w.r.t. the hidden states
    dW    += g.T @ h_c        [V, H]   gradient w.r.t. the embedding

where g = d(sum of losses)/d(logits). Only the softmax part of g is dense in V; it is passed
through the GEMMs as the in-place exp of the logits buffer, and the row scales, one-hot and
label-smoothing parts are applied to the small [n, H] / [V, H] sides (see `_chunk_pass`), so
the [n, V] buffer is touched by just 4 elementwise passes (max, subtract, exp, sum; on CPU block by
block of rows that stay in cache, `_exp_shifted_`).
backward() only multiplies the stored dh and dW by the incoming scalar gradient (in place: it runs
once; retain_graph is not supported). Under
no_grad (evaluation) only the first GEMM runs.

Per token i with target y_i (targets equal to ignore_index are skipped everywhere), logits z
and lse = logsumexp(z):

    ce_i       = lse - z_y                                   (pure cross-entropy)
    smoothed_i = (1-eps) * (lse - z_y) + eps * (lse - mean_v z_v)   (PyTorch label_smoothing)
    zloss_i    = lse^2
    total_i    = smoothed_i + c * zloss_i

and the gradient of total_i w.r.t. the logits is

    g_i = softmax(z) * (1 + 2 * c * lse) - (1-eps) * onehot(y_i) - eps / V

All results are sums over tokens (not means): the caller divides by the token count of the
whole accumulated batch, which keeps gradient accumulation exact.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class LossSums:
    """Summed loss statistics of one batch (or micro-batch)."""

    total: torch.Tensor  # 0-dim, differentiable: sum of total_i (smoothed CE + z-loss)
    ce: torch.Tensor  # 0-dim, detached: sum of pure cross-entropy terms
    z: torch.Tensor  # 0-dim, detached: sum of lse^2
    tokens: torch.Tensor  # 0-dim int64: number of non-ignored targets


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype logits and sums are computed in: fp32 for bf16/fp16/fp32, fp64 for fp64."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _flatten(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor):
    if weight.dim() != 2 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(f"hidden {tuple(hidden.shape)} and weight {tuple(weight.shape)} do not match")
    h = hidden.reshape(-1, hidden.shape[-1])
    t = targets.reshape(-1)
    if t.shape[0] != h.shape[0]:
        raise ValueError(f"hidden has {h.shape[0]} tokens but targets has {t.shape[0]}")
    return h, t


_CPU_LOGITS: dict[tuple[torch.dtype, int], torch.Tensor] = {}


def _logits_buffer(rows: int, vocab: int, like: torch.Tensor) -> torch.Tensor:
    """Scratch for one chunk's [rows, vocab] logits. On CPU one buffer is kept from call to call: a fresh
    multi-GB allocation is mapped anew by the OS every step, and its page faults cost about as much as
    the elementwise passes over it (1.6 GB: ~0.4 s on the 2-core CI machine). GPU allocations come from
    torch's caching allocator, which already reuses the block."""
    if like.device.type != "cpu":
        return torch.empty(rows, vocab, dtype=like.dtype, device=like.device)
    key = (like.dtype, vocab)
    buf = _CPU_LOGITS.get(key)
    if buf is None or buf.shape[0] < rows:
        _CPU_LOGITS.clear()  # one buffer at a time: the largest chunk seen
        buf = _CPU_LOGITS[key] = torch.empty(rows, vocab, dtype=like.dtype)
    return buf[:rows]


_CPU_BLOCK_BYTES_PER_THREAD = 2**20  # logits per elementwise block, CPU, per thread: in L2 for 4 passes


def _exp_shifted_(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """In place: logits -> e = exp(logits - row max). Returns (e, row max, row sum of e).

    Four passes over the rows (max, subtract, exp, sum). On CPU they walk blocks of rows small enough to
    stay in the cores' L2 caches, so the [n, V] buffer (1.6 GB for 2,048 tokens at V = 200k) comes from
    memory once instead of four times (0.32 s -> 0.19 s per 2,048 tokens on the 2-core CI machine). GPUs get
    one block (fewer launches)."""
    rows, vocab = logits.shape
    block = rows
    if logits.device.type == "cpu":
        block_bytes = _CPU_BLOCK_BYTES_PER_THREAD * torch.get_num_threads()
        block = max(1, block_bytes // (vocab * logits.element_size()))
    z_max, sum_exp = logits.new_empty(rows), logits.new_empty(rows)
    for start in range(0, rows, block):
        part, end = logits[start : start + block], min(start + block, rows)
        torch.amax(part, dim=1, out=z_max[start:end])
        part.sub_(z_max[start:end, None]).exp_()
        torch.sum(part, dim=1, out=sum_exp[start:end])
    return logits, z_max, sum_exp


def _chunk_pass(
    h: torch.Tensor,
    w: torch.Tensor,
    t: torch.Tensor,
    chunk_tokens: int,
    label_smoothing: float,
    z_loss: float,
    ignore_index: int,
    need_dh: bool,
    need_dw: bool,
):
    """One pass over the tokens in chunks. Returns (total, ce, z, dh, dw); dh / dw are None
    unless requested. Everything stays on the device: no host syncs."""
    n_tok, _ = h.shape
    vocab = w.shape[0]
    eps = float(label_smoothing)
    c = float(z_loss)
    acc = _acc_dtype(h.dtype)
    chunk = n_tok if chunk_tokens <= 0 else chunk_tokens
    chunk = max(chunk, 1)
    need_grad = need_dh or need_dw
    zero = torch.zeros((), dtype=acc, device=h.device)

    total = torch.zeros((), dtype=acc, device=h.device)
    ce_sum = torch.zeros((), dtype=acc, device=h.device)
    z_sum = torch.zeros((), dtype=acc, device=h.device)
    # mean embedding row: mean_v z_v = h @ mean_v W_v, so the smoothing term needs no pass over
    # the [n, V] logits (and neither does its gradient, see below)
    w_mean = w.sum(dim=0, dtype=acc) / vocab if eps != 0.0 else None  # [H]
    dh = torch.empty_like(h) if need_dh else None
    # dW accumulates over chunks (the first one writes it: no zero-fill); in fp32 when W is bf16/fp16 so
    # that the sum does not lose bits
    dw = (torch.empty if n_tok else torch.zeros)(w.shape, dtype=acc, device=w.device) if need_dw else None
    h_valid_sum = torch.zeros(h.shape[1], dtype=acc, device=h.device)  # sum of non-ignored h_i

    for start in range(0, n_tok, chunk):
        end = min(start + chunk, n_tok)
        h_c = h[start:end]  # [n, H]
        t_c = t[start:end]  # [n]
        valid = t_c != ignore_index  # [n] bool
        valid_f = valid.to(acc)  # [n] 1.0 / 0.0
        t_safe = torch.where(valid, t_c, torch.zeros_like(t_c))  # ignored rows point at token 0

        # logits of this chunk, upcast to fp32 if the GEMM ran in bf16/fp16. This [n, V]
        # buffer is the only big one and is reused in place: logits -> exp(logits - max).
        logits = torch.mm(h_c, w.t(), out=_logits_buffer(end - start, vocab, h_c))
        if logits.dtype != acc:
            logits = logits.to(acc)
        z_target = logits.gather(1, t_safe[:, None]).squeeze(1)  # [n] z_y

        # numerically stable log-sum-exp, leaving e = exp(z - max) in the buffer
        e, z_max, sum_exp = _exp_shifted_(logits)
        lse = z_max + sum_exp.log()  # [n]

        # per-token loss terms, with ignored rows zeroed before summing
        ce_i = lse - z_target
        if eps != 0.0:
            z_mean = h_c.to(acc) @ w_mean  # [n] mean_v z_v
            smooth_i = (1.0 - eps) * ce_i + eps * (lse - z_mean)
        else:
            smooth_i = ce_i
        zl_i = lse * lse
        total_i = smooth_i + c * zl_i if c != 0.0 else smooth_i
        total = total + torch.where(valid, total_i, zero).sum()
        ce_sum = ce_sum + torch.where(valid, ce_i, zero).sum()
        z_sum = z_sum + torch.where(valid, zl_i, zero).sum()

        if not need_grad:
            continue

        # Gradient of the summed loss w.r.t. this chunk's logits (0 on ignored rows):
        #   g = softmax * (1 + 2c*lse) - (1-eps) * onehot(y) - eps/V
        #     = r * e                  - (1-eps) * onehot(y) - eps/V,   r = (1 + 2c*lse) / sum_exp
        # Only the r * e part touches all V columns. It goes through the GEMMs as e, with the
        # row scale r applied to the small [n, H] side; the one-hot and uniform parts are
        # added afterwards as cheap [n, H] / [V, H] corrections:
        #   dh_c = g @ W    = r * (e @ W)     - (1-eps) * W[y]           - eps * mean_v W_v
        #   dW  += g.T @ h_c = e.T @ (r * h_c) - (1-eps) * scatter_y(h_c) - eps/V * sum_i h_i
        r = (1.0 + 2.0 * c * lse) * valid_f / sum_exp  # [n]
        e_mm = e.to(w.dtype)  # no-op for fp32 weights
        if need_dh:
            dh_c = torch.mm(e_mm, w).to(acc).mul_(r[:, None])
            dh_c.sub_(w[t_safe].to(acc) * ((1.0 - eps) * valid_f)[:, None])
            if eps != 0.0:
                dh_c.sub_(w_mean[None, :] * (eps * valid_f)[:, None])
            dh[start:end] = dh_c
        if need_dw:
            h_acc = h_c.to(acc)
            h_scaled = (h_acc * r[:, None]).to(w.dtype)  # r * h_c
            if dw.dtype == w.dtype:  # dW (+)= e.T @ (r * h_c), in place
                if start == 0:
                    torch.mm(e_mm.t(), h_scaled, out=dw)
                else:
                    torch.addmm(dw, e_mm.t(), h_scaled, out=dw)
            else:  # bf16/fp16 GEMM, fp32 accumulation
                part = torch.mm(e_mm.t(), h_scaled)
                dw.copy_(part) if start == 0 else dw.add_(part)
            dw.index_add_(0, t_safe, h_acc * ((1.0 - eps) * valid_f)[:, None], alpha=-1.0)
            if eps != 0.0:
                h_valid_sum += (h_acc * valid_f[:, None]).sum(dim=0)
        del logits, e, e_mm

    if dw is not None:
        if eps != 0.0:
            dw.sub_(h_valid_sum[None, :] * (eps / vocab))  # the uniform part, once for all chunks
        dw = dw.to(w.dtype)
    return total, ce_sum, z_sum, dh, dw


class _ChunkedTiedCE(torch.autograd.Function):
    """Autograd wrapper: the forward does all the work (loss + gradients), the backward scales."""

    @staticmethod
    def forward(ctx, h, w, t, chunk_tokens, label_smoothing, z_loss, ignore_index, need_dh, need_dw):
        total, ce_sum, z_sum, dh, dw = _chunk_pass(
            h, w, t, chunk_tokens, label_smoothing, z_loss, ignore_index, need_dh, need_dw
        )
        ctx.dh, ctx.dw, ctx.done = dh, dw, False
        ctx.mark_non_differentiable(ce_sum, z_sum)
        return total, ce_sum, z_sum

    @staticmethod
    def backward(ctx, grad_total, _grad_ce, _grad_z):
        # d(total)/dh and d(total)/dW are already known; chain rule with the scalar grad_total, in place,
        # and handed over: a fresh [V, H] product every step cost more than the multiply itself (its page
        # faults: ~0.6 s of a 6.5 s CPU step at 100m). So a second backward (retain_graph) cannot run.
        if ctx.done:
            raise RuntimeError(
                "chunked_tied_ce: backward ran twice; its gradients are computed once, in the forward "
                "(retain_graph is not supported: use loss.backend=torch for that)"
            )
        ctx.done = True
        dh, dw, ctx.dh, ctx.dw = ctx.dh, ctx.dw, None, None
        if dh is not None:
            dh.mul_(grad_total.to(dh.dtype))
        if dw is not None:
            dw.mul_(grad_total.to(dw.dtype))
        return dh, dw, None, None, None, None, None, None, None


def chunked_tied_ce(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    chunk_tokens: int = 4096,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    ignore_index: int = -100,
) -> LossSums:
    """hidden [..., H] (flattened to [N, H]), weight [V, H], targets [...] (flattened to [N]).

    Exact (label-smoothed) cross-entropy + z-loss of logits hidden @ weight.T, summed over the
    non-ignored tokens, computed `chunk_tokens` rows at a time (<= 0 means a single chunk).
    """
    h, t = _flatten(hidden, weight, targets)
    tokens = (t != ignore_index).sum()
    need_dh = hidden.requires_grad
    need_dw = weight.requires_grad
    if torch.is_grad_enabled() and (need_dh or need_dw):
        total, ce_sum, z_sum = _ChunkedTiedCE.apply(
            h, weight, t, chunk_tokens, label_smoothing, z_loss, ignore_index, need_dh, need_dw
        )
    else:
        # evaluation: loss only, one GEMM per chunk, no graph
        with torch.no_grad():
            total, ce_sum, z_sum, _, _ = _chunk_pass(
                h, weight, t, chunk_tokens, label_smoothing, z_loss, ignore_index, False, False
            )
    return LossSums(total=total, ce=ce_sum.detach(), z=z_sum.detach(), tokens=tokens)


def full_logits_ce(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    ignore_index: int = -100,
) -> LossSums:
    """Reference implementation materialising the full [N, V] logits; same contract as
    `chunked_tied_ce`. Gradients come from plain autograd."""
    h, t = _flatten(hidden, weight, targets)
    logits = (h @ weight.t()).to(_acc_dtype(h.dtype))
    valid = t != ignore_index
    tokens = valid.sum()

    smoothed = F.cross_entropy(
        logits, t, ignore_index=ignore_index, label_smoothing=label_smoothing, reduction="sum"
    )
    lse = torch.logsumexp(logits, dim=1)
    z_sum = torch.where(valid, lse * lse, torch.zeros_like(lse)).sum()
    total = smoothed + z_loss * z_sum if z_loss != 0.0 else smoothed
    with torch.no_grad():
        ce_sum = F.cross_entropy(logits, t, ignore_index=ignore_index, reduction="sum")
    return LossSums(total=total, ce=ce_sum.detach(), z=z_sum.detach(), tokens=tokens)
