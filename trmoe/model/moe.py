"""The token-routed MoE FFN (TR-MoE):

    y = a * g_s * S(x)  +  b * g_r * sum_k w_k * E_{r_k(t)}(x)

S is the always-on shared SwiGLU expert (width shared_width, absent when 0); E_e are the E routed SwiGLU
experts of width routed_width / E; r_k(t) is the k-th expert of token id t in this layer's fixed route table;
w_0 = p and w_k = (1 - p) / (K - 1) for k >= 1; g_s, g_r are optional learnable scalar gates; a, b are fixed
output scales (optionally interpolated over depth by the caller).

Dispatch: each token runs through exactly its K experts: K x tokens expert rows of work, never E x tokens.
Rows are grouped so that both projections run as one grouped GEMM each (the group offsets stay on the
device: no host sync), in one of two ways, fixed per layer by its route table:
  - by route tuple, when the table holds no more distinct tuples (r_0, ..., r_{K-1}) than experts
    (modulo_cyclic: exactly E; any table at K = 1): tokens are sorted by tuple and each token is one row
    multiplied by its K experts' weights side by side ([H, 2KW], gathered per tuple: weight-sized copies).
    Gathering the inputs and putting the outputs back are row permutations of N rows, gradients included:
    no scatter-add, and half the rows the second way moves at K = 2. The route weights and the branch's
    gate x scale fold into the gathered output weights.
  - by expert otherwise: the (token, route) pairs are sorted by expert, K x N rows; the route weight and
    gate x scale multiply the narrow [rows, W] activation, and one index_add sums each token's K rows.
Either way the routed rows are summed straight into the shared expert's output.

The router strategies (the controls: learned, learned_v3, frozen_router, rerandomised_router): r_k and w_k
come from a linear router instead of the table and p (TRMoEFFN._route); its rows go by expert.

routing.combine=learned (DeepSeek-V4's hash layers): r_k stay the table's (or the hashed key's), w_k come from
a bias-free linear gate W_g [E, H] of the layer (TRMoEFFN._combine):

    g = sqrt(softplus(x W_g^T))  (at least fp32),   w_k = g_{r_k} / sum_j g_{r_j}

and the rows go by expert. No loss term reads the gate: only the cross-entropy trains it (a table layer
never carries a balance or z loss; TRMoETransformer.router_losses refuses one).

A dense layer (routing.layers' `dense`, DeepSeek's first_k_dense_replace) has no routed branch; its FFN is one
SwiGLU of the routed layer's active width:

    y = a * S'(x),   width(S') = shared_width + K * routed_width / E

so it holds exactly the FFN weights a token passes through in a routed layer (3 H (S + K W_e)): the two kinds
of layer have equal active parameters (a routed layer's router or combine gate, E x H, is its own extra: the
count shows it). Its total is smaller by the (E - K) experts a token does not visit. Its weights are the
shared expert's (`ffn.shared.*`: the shared parameter group, the residual-writer init on w_out); it has no
gates (there is no second branch to weigh) and its scale is the layer's shared scale a.

Over 400 lines on purpose: the FFN's formula, its two dispatch paths and the learned router share the
branch's weights and gates; they are read together to check that both paths compute the formula above.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from trmoe.model.context_routing import hash_routes, units_tensor
from trmoe.model.routing import (
    DISTILL_FALLBACK,
    REGISTRY,
    build_route_table,
    draw_router,
    layer_salt,
    load_token_counts,
    tuple_grouping,
)
from trmoe.model.spec import ModelSpec


class _SiluMul(torch.autograd.Function):
    """silu(g) * u from the fused projection gu = [g | u] [rows, 2W]. Autograd of `chunk` would give the two
    halves' gradients their own tensors and then concatenate them (a copy of the whole [rows, 2W]); this
    backward writes both straight into one."""

    @staticmethod
    def forward(ctx, gu: torch.Tensor) -> torch.Tensor:
        gate, up = gu.chunk(2, dim=-1)
        silu = F.silu(gate)
        ctx.save_for_backward(gu, silu)
        return silu * up

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        gu, silu = ctx.saved_tensors
        gate, up = gu.chunk(2, dim=-1)
        grad_gu = torch.empty_like(gu)
        grad_gate, grad_up = grad_gu.chunk(2, dim=-1)
        torch.mul(grad, silu, out=grad_up)
        torch.ops.aten.silu_backward.grad_input(grad * up, gate, grad_input=grad_gate)
        return grad_gu


class _PermuteRows(torch.autograd.Function):
    """x[perm] for a permutation of the rows; its gradient is the inverse permutation of the upstream one
    (autograd's index_select backward would zero-fill and scatter-add instead)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, perm: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(inverse)
        return x.index_select(0, perm)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        (inverse,) = ctx.saved_tensors
        return grad.index_select(0, inverse), None, None


def permute_rows(x: torch.Tensor, perm: torch.Tensor, inverse: torch.Tensor) -> torch.Tensor:
    """x[perm], with `inverse` the inverse permutation (inverse[perm] = arange)."""
    return _PermuteRows.apply(x, perm, inverse)


def silu_mul(gu: torch.Tensor) -> torch.Tensor:
    """The SwiGLU activation silu(g) * u of gu = [g | u] (last dimension 2W) -> [.., W]."""
    if torch.compiler.is_compiling():
        # the compiler fuses the plain formula, backward included; the custom backward's out= writes
        # into halves of one tensor, which Dynamo cannot trace (a graph break at every SwiGLU)
        gate, up = gu.chunk(2, dim=-1)
        return F.silu(gate) * up
    return _SiluMul.apply(gu)


def swiglu(x: torch.Tensor, w_in: torch.Tensor, w_out: torch.Tensor) -> torch.Tensor:
    """SwiGLU with the gate and up projections fused in w_in [H, 2W]; w_out [W, H]."""
    return silu_mul(x @ w_in) @ w_out


# public since torch 2.10; the private op (CUDA, Hopper) before that
_GROUPED_MM = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def grouped_mm(rows: torch.Tensor, weights: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """rows [M, A] grouped contiguously, weights [G, A, B], ends [G] (cumulative row counts; int32 spares a
    cast per call) -> [M, B]: group g's rows times weights[g]. One grouped GEMM where torch has one for
    these shapes and dtypes (offsets stay on the device, so no host sync); otherwise a loop over the groups
    (that reads the offsets on the host)."""
    if rows.device.type == "cuda" and torch.is_autocast_enabled("cuda"):
        dtype = torch.get_autocast_dtype("cuda")  # autocast does not cover the grouped GEMM: cast as it would
        rows, weights = rows.to(dtype), weights.to(dtype)
    if _grouped_mm_ok(rows, weights):
        return _GROUPED_MM(rows, weights, offs=ends.to(torch.int32))
    bounds = [0] + ends.tolist()
    return torch.cat([rows[bounds[g] : bounds[g + 1]] @ weights[g] for g in range(weights.shape[0])])


def _grouped_mm_ok(rows: torch.Tensor, weights: torch.Tensor) -> bool:
    # torch's grouped GEMM: fp32/bf16 on CPU, bf16 on Hopper or newer GPUs; 16-byte aligned row strides
    if _GROUPED_MM is None or rows.dtype != weights.dtype or not rows.dtype.is_floating_point:
        return False
    if rows.dtype == torch.float64:
        return False
    if rows.dtype != torch.bfloat16 and torch.compiler.is_compiling():
        return False  # the op's meta function (what torch.compile traces with) accepts bf16 only
    if rows.device.type == "cuda":
        if rows.dtype != torch.bfloat16 or torch.cuda.get_device_capability(rows.device) < (9, 0):
            return False
    elif rows.device.type != "cpu" or not hasattr(F, "grouped_mm"):
        return False
    align = 16 // rows.element_size()
    return rows.shape[1] % align == 0 and weights.shape[2] % align == 0


def route_weights(top_k: int, primary_weight: float) -> list[float]:
    """Fixed (input-independent) weights of the K routes: p for route 0, the rest split (1-p) evenly."""
    if top_k == 1:
        return [1.0]
    return [primary_weight] + [(1.0 - primary_weight) / (top_k - 1)] * (top_k - 1)


class SharedExpert(nn.Module):
    def __init__(self, hidden_size: int, width: int):
        super().__init__()
        self.w_in = nn.Parameter(torch.empty(hidden_size, 2 * width))  # [gate | up]
        self.w_out = nn.Parameter(torch.empty(width, hidden_size))
        # Memory, not math (trainer.shared_chunk_tokens): run this many tokens at a time, each chunk
        # recomputed in the backward, so its [n, 3W] intermediates never exist for all tokens at once.
        self.chunk_tokens = 0

    def forward(self, x: torch.Tensor, factor: torch.Tensor | float = 1.0) -> torch.Tensor:
        """x [N, H] -> factor * SwiGLU(x) [N, H]; the factor (gate x scale) multiplies the [W, H] output
        weight, not the [N, H] output, so its gradient is weight-sized and no output is kept for it."""
        w_out = _scaled(self.w_out, factor)
        n = self.chunk_tokens
        if n <= 0 or x.shape[0] <= n:
            return swiglu(x, self.w_in, w_out)
        if not torch.is_grad_enabled():
            return torch.cat([swiglu(c, self.w_in, w_out) for c in x.split(n)])
        return torch.cat([checkpoint(swiglu, c, self.w_in, w_out, use_reentrant=False) for c in x.split(n)])


class RoutedExperts(nn.Module):
    """E SwiGLU experts stored as stacked tensors, plus this layer's route table [K, vocab] (none for a
    learned router: its routes come with each forward)."""

    def __init__(self, spec: ModelSpec, layer: int):
        super().__init__()
        num_experts, top_k = spec.num_experts, spec.top_k
        self.num_experts, self.top_k = num_experts, top_k
        # The K route weights live in a small buffer (not saved: p is config or a pure function of the
        # step), so a p schedule changes no graph and costs no host-to-device copy per forward.
        self.register_buffer(
            "route_w", torch.tensor(route_weights(top_k, spec.primary_weight)), persistent=False
        )
        self._primary_weight = float(spec.primary_weight)
        width = spec.routed_width // num_experts
        self.w_in = nn.Parameter(torch.empty(num_experts, spec.hidden_size, 2 * width))
        self.w_out = nn.Parameter(torch.empty(num_experts, width, spec.hidden_size))
        self._last_routes: torch.Tensor | None = None  # a learned router's routes of the last forward
        strategy = spec.strategy_of(layer)
        entry = REGISTRY[strategy]
        # a hashed key (trmoe.model.context_routing): routes = hash_routes(key, salt), no table
        self.hash_salt = layer_salt(spec.route_seed, layer) if entry.hashed else None
        self.register_buffer(
            "hash_units", units_tensor(num_experts) if entry.hashed else None, persistent=False
        )
        # A persistent buffer: saved in every checkpoint, identical on every rank, never trained.
        if not entry.has_table:
            table = None
        elif self.w_in.device.type == "meta":
            table = torch.empty(top_k, spec.vocab_size, dtype=torch.uint8, device="meta")
        else:
            freq = load_token_counts(spec.route_frequencies) if spec.route_frequencies else None
            # distilled: its never-seen rule's table until the run sets the counted one (set_route_table,
            # trmoe.distill) or a checkpoint loads it
            table = build_route_table(
                DISTILL_FALLBACK if entry.distilled else strategy,
                spec.vocab_size,
                num_experts,
                top_k,
                layer,
                spec.route_seed,
                spec.hash_count,
                freq,
                spec.route_embedding,
            )
        self.register_buffer("route_table", table)
        ids_dtype = table.dtype if table is not None else torch.int64
        self.register_buffer("expert_ids", torch.arange(num_experts, dtype=ids_dtype), persistent=False)
        self._index_tuples()
        # a loaded route table replaces the built one: derive the tuples from it
        self.register_load_state_dict_post_hook(lambda module, _keys: module._index_tuples())

    def set_route_table(self, table: torch.Tensor) -> None:
        """Replace the route table ([K, vocab] expert ids) and re-derive the tuple grouping. The table is
        otherwise fixed: change it through this or load_state_dict, never in place."""
        with torch.no_grad():
            self.route_table.copy_(table)
        self._index_tuples()

    def _index_tuples(self) -> None:
        """Group by route tuple (see the module docstring) when the table has at most E distinct tuples:
        `route_tuples` [C, K], `tuple_of` [vocab] and `tuple_ids` [C], non-persistent buffers derived
        from route_table (None when grouping by expert)."""
        grouping = None
        if self.route_table is not None and self.route_table.device.type != "meta":
            grouping = tuple_grouping(self.route_table.cpu(), self.num_experts)
        tuples, tuple_of, ids = None, None, None
        if grouping is not None:
            device = self.route_table.device
            tuples, tuple_of = grouping[0].to(device), grouping[1].to(device)
            ids = torch.arange(len(tuples), dtype=tuple_of.dtype, device=device)
        self.register_buffer("route_tuples", tuples, persistent=False)
        self.register_buffer("tuple_of", tuple_of, persistent=False)
        self.register_buffer("tuple_ids", ids, persistent=False)

    def routes(self, token_ids: torch.Tensor) -> torch.Tensor:
        """[K*N] expert ids the last forward over `token_ids` [N] (the route keys) used (route-major): the
        table's, the hashed key's, or those a learned router chose in that forward."""
        if self.hash_salt is None and self.route_table is None:
            return self._last_routes.reshape(-1)
        return self._fixed_routes(token_ids.reshape(-1)).reshape(-1)

    def _fixed_routes(self, keys: torch.Tensor) -> torch.Tensor:
        """[K, N] expert ids of route keys [N]: the table's column of each token id, or the hashed key's."""
        if self.hash_salt is not None:
            return hash_routes(keys, self.num_experts, self.top_k, self.hash_salt, self.hash_units)
        return self.route_table[:, keys]

    @property
    def primary_weight(self) -> float:
        """p, a plain float; setting it (a schedule, between steps) updates the route weights."""
        return self._primary_weight

    @primary_weight.setter
    def primary_weight(self, value: float) -> None:
        self._primary_weight = float(value)
        exact = torch.tensor(route_weights(self.top_k, value), dtype=torch.float64)
        with torch.no_grad():
            self.route_w.copy_(exact.to(self.route_w.dtype))  # rounded once, on the host (MPS has no fp64)

    def _apply(self, fn, recurse=True):
        # .double() / .to(dtype) would otherwise widen the rounded fp32 weights: rebuild them exactly
        super()._apply(fn, recurse)
        self.primary_weight = self._primary_weight
        return self

    def forward(
        self,
        x: torch.Tensor,
        token_ids: torch.Tensor,
        scale: torch.Tensor | float = 1.0,
        into: torch.Tensor | None = None,
        routing: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """x [N, H], token_ids [N] -> scale * sum_k w_k E_{r_k}(x), [N, H]; added in place into `into` [N, H]
        and returned as it when given (the shared branch's output: no separate sum to allocate and add).
        `routing` = (experts [K, N], weights [K, N]) of a learned router replaces the table and p."""
        if routing is not None:
            self._last_routes = routing[0].detach()
            return self._by_expert(x, token_ids, scale, into, routing)
        if self.num_experts == 1:  # dense control: every token to the single expert, weight 1
            out = swiglu(x, self.w_in[0], _scaled(self.w_out[0], scale))
            return out if into is None else into.add_(out)
        if self.route_tuples is not None:
            out = self._by_tuple(x, token_ids, scale)
            return out if into is None else into.add_(out)
        return self._by_expert(x, token_ids, scale, into)

    def _by_expert(
        self,
        x: torch.Tensor,
        token_ids: torch.Tensor,
        scale: torch.Tensor | float,
        into: torch.Tensor | None,
        routing: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """One row per (token, route), sorted by expert; index_add sums each token's K rows."""
        n = x.shape[0]
        table = self._fixed_routes(token_ids) if routing is None else routing[0]
        experts = table.reshape(-1)  # [K*N], index = route * N + token
        grouped, order = torch.sort(experts, stable=True)  # group (token, route) pairs by expert
        # group boundaries found on the device (bincount would read its size on the host: a sync)
        ends = torch.searchsorted(grouped, self.expert_ids, right=True, out_int32=True)
        token_of = order % n
        xs = x.index_select(0, token_of)
        # each row's route weight, times the branch factor afterwards: indexing a learnable 0-dim gate
        # directly would make its gradient a K*N-way scatter into one element (slow on GPUs)
        if routing is None:
            row_w = self.route_w[order // n]
        else:  # the learned weights, each row its own (token, route)'s
            row_w = routing[1].reshape(-1).index_select(0, order)
        row_scale = row_w.unsqueeze(1).to(x.dtype) * scale  # [K*N, 1]
        out = grouped_mm(silu_mul(grouped_mm(xs, self.w_in, ends)) * row_scale, self.w_out, ends)
        combined = out.new_zeros(n, out.shape[1]) if into is None else into
        return combined.index_add_(0, token_of, out.to(combined.dtype))

    def _by_tuple(
        self, x: torch.Tensor, token_ids: torch.Tensor, scale: torch.Tensor | float
    ) -> torch.Tensor:
        """One row per token, sorted by route tuple; each tuple's K experts run side by side as one SwiGLU
        of width K x W (the same work as K rows of width W)."""
        tuples = self.route_tuples
        (c, k), h, w = tuples.shape, self.w_in.shape[1], self.w_in.shape[2] // 2
        grouped, order = torch.sort(self.tuple_of[token_ids], stable=True)
        ends = torch.searchsorted(grouped, self.tuple_ids, right=True, out_int32=True)
        inverse = torch.argsort(order)
        flat = tuples.reshape(-1)
        # [C, H, 2KW], laid out [gate of r_0..r_{K-1} | up of r_0..r_{K-1}] for silu_mul
        w_in = (
            self.w_in.index_select(0, flat)
            .view(c, k, h, 2, w)
            .permute(0, 2, 3, 1, 4)
            .reshape(c, h, 2 * k * w)
        )
        # [C, KW, H], each expert's rows times its route weight and the branch factor
        w_out = _scaled(
            self.w_out.index_select(0, flat).view(c, k, w, h), self.route_w.view(1, k, 1, 1) * scale
        )
        rows = permute_rows(x, order, inverse)
        out = grouped_mm(silu_mul(grouped_mm(rows, w_in, ends)), w_out.reshape(c, k * w, h), ends)
        return permute_rows(out, inverse, order)


class TRMoEFFN(nn.Module):
    """The FFN of one layer, built from the model spec (see the module docstring for its formula). With a
    router strategy (learned, frozen_router, rerandomised_router) a linear router replaces the table and p:

        P = softmax(x W_r^T)  (at least fp32),   r_k = the K largest of P,   w_k = P_{r_k} / sum_j P_{r_j}

    and each forward leaves its two router loss terms (see `_route`) for the objective. W_r [E, H]
    is a parameter (learned), a parameter that never takes a gradient (frozen_router: requires_grad False,
    so no optimizer holds it and parameter counts leave it out, as they leave out route tables), or a
    persistent buffer redrawn before every optimizer step (rerandomised_router, `redraw_router`).

    learned_v3 (DeepSeek-V3, arXiv 2412.19437 §2.1.2) trains W_r with sigmoid scores and a balancing bias
    b [E]:

        s = sigmoid(x W_r^T)  (at least fp32),  r_k = the K largest of s + b,  w_k = s_{r_k} / sum_j s_{r_j}

    b is routing state, not a parameter (a persistent buffer: in the checkpoint, in no optimizer, in no
    parameter count); after every applied optimizer step `update_bias` sets
    b_e <- b_e + gamma * sign(mean_e' load_e' - load_e) from the step's loads (routed slots per expert over
    its micro-batches and ranks, accumulated in `route_load` by the training forwards). Its forward leaves
    the sequence-wise balance term (see `_route_v3`), which routing.seq_aux_weight weighs (0: off)."""

    def __init__(self, spec: ModelSpec, layer: int):
        super().__init__()
        shared_width = spec.shared_width_of(layer)  # a dense layer: widened to the routed active width
        self.shared = SharedExpert(spec.hidden_size, shared_width) if shared_width > 0 else None
        self.routed = RoutedExperts(spec, layer) if spec.routed_width_of(layer) > 0 else None
        entry = REGISTRY[spec.strategy_of(layer)]
        kind = entry.router if self.routed is not None else ""
        self.router_kind = kind  # "" (a route table), "trained", "frozen" or "rerandomised"
        self.scoring = entry.scoring if kind else ""  # "softmax" or "sigmoid_bias" (learned_v3)
        self._redraw = (spec.route_seed, layer, spec.init_std)  # rerandomised_router's draw arguments
        shape = (spec.num_experts, spec.hidden_size)
        if kind == "rerandomised":
            self.router = None
            self.register_buffer("router_draw", torch.empty(shape))
            if self.router_draw.device.type != "meta":
                self.redraw_router(0)
        else:
            # [E, H]: in the base parameter group (it is not an expert), as the reference's router.weight; a
            # frozen one is drawn by reset_parameters exactly as a trained one (same place in the order)
            trained = kind == "trained"
            self.router = nn.Parameter(torch.empty(shape), requires_grad=trained) if kind else None
        if self.scoring == "sigmoid_bias":
            # routing state: saved (bit-exact resume), never trained; fp32 whatever the model's dtype, so that
            # gamma-sized steps are not rounded away in a bf16 copy
            self.register_buffer("route_bias", torch.zeros(spec.num_experts, dtype=torch.float32))
            # this step's routed slots per expert (training forwards only; zeroed by `reset_load`)
            self.register_buffer("route_load", torch.zeros(spec.num_experts), persistent=False)
        else:
            self.route_bias = self.route_load = None
        # routing.combine=learned: learned combine weights over the table's routes (a plain linear map, drawn
        # by reset_parameters as every matrix is; its rows are the experts, as a router's)
        learned_combine = spec.combine == "learned" and not kind and self.routed is not None
        self.combine_gate = (
            nn.Linear(spec.hidden_size, spec.num_experts, bias=False)
            if learned_combine and spec.num_experts > 1
            else None
        )
        key = REGISTRY[spec.strategy_of(layer)].key
        self._route_key = (key or "token") if self.routed is not None else "token"
        # the loss terms of the last forward, by name: {"aux", "z"} (softmax) or {"seq_aux"} (learned_v3)
        self.router_terms: dict[str, torch.Tensor] | None = None
        # the gates weigh the two branches against each other: with one branch there is nothing to weigh (a
        # lone gate would only rescale what the branch's output weight already can; the reference has none)
        gated = spec.gates and self.shared is not None and self.routed is not None
        self.shared_gate = nn.Parameter(torch.tensor(float(spec.shared_gate_init))) if gated else None
        self.routed_gate = nn.Parameter(torch.tensor(float(spec.routed_gate_init))) if gated else None
        # fixed, not trained
        self.shared_scale, self.routed_scale = spec.shared_scales[layer], spec.routed_scales[layer]

    @property
    def route_key(self) -> str:
        """What this layer's routes read of each position (trmoe.model.context_routing.KEY_KINDS)."""
        return self._route_key

    def forward(self, x: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        """x [.., H], token_ids [..]: the route keys of `route_key`'s kind (the input ids for a table)."""
        shape = x.shape
        x, token_ids = x.reshape(-1, shape[-1]), token_ids.reshape(-1)
        y = None
        # each branch's gate x scale goes into its weights or narrow activation, not onto its [N, H] output
        if self.shared is not None:
            y = self.shared(x, _factor(self.shared_scale, self.shared_gate))
        if self.routed is not None:
            if self.router_kind:
                routing = self._route(x, shape[-2] if len(shape) > 2 else x.shape[0])
            elif self.combine_gate is not None:
                routing = self._combine(x, token_ids)
            else:
                routing = None
            # the routed rows are summed straight into the shared branch's output (no zero-filled [N, H] of
            # their own, no extra add: ~2% of a panel-A FFN on CPU)
            y = self.routed(
                x, token_ids, _factor(self.routed_scale, self.routed_gate), into=y, routing=routing
            )
        return y.reshape(shape)

    def _combine(self, x: torch.Tensor, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """routing.combine=learned: (the fixed routes [K, N], their learned weights [K, N]), see the module
        docstring."""
        routes = self.routed._fixed_routes(keys).long()
        logits = self.combine_gate(x)
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # at least fp32 (bf16 autocast)
        g = F.softplus(logits).sqrt().gather(1, routes.t())  # [N, K]
        # softplus > 0, but it underflows to 0 below about -88 (fp32): never divide by 0
        weights = g / g.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(g.dtype).tiny)
        return routes, weights.t().to(x.dtype)

    def _route(self, x: torch.Tensor, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The learned router: (experts [K, N], weights [K, N]); records this forward's loss terms

            aux = E * sum_e f_e * mean_n P_e,   f_e = (top-K slots given to e) / (N K), detached
            z   = mean_n logsumexp(logits_n)^2

        over this micro-batch (the reference's Switch/GShard form; a uniform router gives aux = 1).
        learned_v3's are `_route_v3`'s (rows of `seq_len` consecutive positions are one sequence)."""
        router = self.router if self.router is not None else self.router_draw
        experts, top_k = router.shape[0], self.routed.top_k
        logits = x @ router.t().to(x.dtype)
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # at least fp32 (bf16 autocast)
        if self.scoring == "sigmoid_bias":
            return self._route_v3(logits, seq_len, x.dtype)
        probs = logits.softmax(dim=-1)  # [N, E]
        top_p, top_e = probs.topk(top_k, dim=-1)
        weights = top_p / top_p.sum(dim=-1, keepdim=True).clamp_min(1e-9)
        slots = torch.zeros(experts, dtype=probs.dtype, device=probs.device)
        slots.scatter_add_(0, top_e.reshape(-1), torch.ones_like(top_p).reshape(-1))
        share = slots / top_e.numel()
        aux = experts * (share * probs.mean(dim=0)).sum()
        z = torch.logsumexp(logits, dim=-1).square().mean()
        self.router_terms = {"aux": aux, "z": z}
        return top_e.t(), weights.t().to(x.dtype)

    def _route_v3(
        self, logits: torch.Tensor, seq_len: int, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """learned_v3 (see the class docstring): the routes, their weights, and the sequence-wise balance term

            seq_aux = mean over sequences of  sum_e f_e * P_e,
            f_e = E / (K T) * (top-K slots given to e in the sequence),
            P_e = mean_t s_{t,e} / sum_e' s_{t,e'}

        (T = seq_len positions; DeepSeek-V3's L_Bal without alpha: a balanced router gives 1). The bias
        picks the experts only: it is detached from the weights and from the loss."""
        experts, top_k = logits.shape[1], self.routed.top_k
        scores = logits.sigmoid()  # [N, E]
        top_e = (scores + self.route_bias.to(scores.dtype)).topk(top_k, dim=-1).indices
        top_s = scores.gather(1, top_e)
        # sigmoid > 0, but it underflows to 0 below about -88 (fp32): never divide by 0
        weights = top_s / top_s.sum(dim=-1, keepdim=True).clamp_min(torch.finfo(top_s.dtype).tiny)
        slots = torch.zeros_like(scores).scatter_(1, top_e, 1.0)  # [N, E] one-hot of the chosen experts
        if torch.is_grad_enabled():
            # the loads of the bias update: training forwards only (evaluation and sampling run without
            # grad). A block recomputed by activation checkpointing counts twice, every expert alike: the
            # sign of (mean - load) does not change.
            self.route_load.add_(slots.sum(dim=0).to(self.route_load.dtype))
        rows = scores.shape[0]
        if rows % seq_len:
            seq_len = rows  # not whole sequences (a caller's flat batch): one sequence
        t = seq_len
        share = (scores / scores.sum(dim=-1, keepdim=True)).view(-1, t, experts).mean(dim=1)  # P [S, E]
        f = slots.view(-1, t, experts).sum(dim=1) * (experts / (top_k * t))  # [S, E]
        self.router_terms = {"seq_aux": (f * share).sum(dim=-1).mean()}
        return top_e.t(), weights.t().to(dtype)

    def reset_load(self) -> None:
        """learned_v3: start a new step's loads (a no-op for the other strategies)."""
        if self.route_load is not None:
            self.route_load.zero_()

    def update_bias(self, loads: torch.Tensor, gamma: float) -> None:
        """learned_v3: b_e <- b_e + gamma * sign(mean(loads) - loads_e), `loads` [E] this step's routed slots
        per expert (over its micro-batches and ranks)."""
        loads = loads.to(torch.float32)
        with torch.no_grad():
            self.route_bias.add_(torch.sign(loads.mean() - loads), alpha=gamma)

    def redraw_router(self, step: int) -> None:
        """rerandomised_router: draw this optimizer step's W_r (routing.draw_router, a pure function of
        (routing.seed, layer, step)); a no-op for the other strategies."""
        if self.router_kind != "rerandomised":
            return
        seed, layer, std = self._redraw
        w = draw_router(seed, layer, step, *self.router_draw.shape, std)
        with torch.no_grad():
            self.router_draw.copy_(w)


def _factor(scale: float, gate: torch.Tensor | None) -> torch.Tensor | float:
    """A branch's output factor: the fixed scale times the learnable gate (when there is one); the gate
    itself at scale 1 (one scalar kernel fewer each way: the GPU FFN is launch-bound at these widths)."""
    if gate is None:
        return scale
    return gate if scale == 1 else gate * scale


def _scaled(weight: torch.Tensor, factor: torch.Tensor | float) -> torch.Tensor:
    """weight x factor, in the weight's dtype (FSDP2 mixed precision: bf16 weights, fp32 gates and route
    weights; an fp32 product would meet bf16 rows in the GEMMs); the weight itself when the factor is the
    plain number 1."""
    if isinstance(factor, float | int) and factor == 1:
        return weight
    return weight * (factor.to(weight.dtype) if isinstance(factor, torch.Tensor) else factor)
