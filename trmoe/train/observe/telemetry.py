"""Expert telemetry (telemetry.moe=true): what the routed experts and the shared expert are doing.

Over each logging window, per layer:
  - route slots per expert (a token adds K counts per layer, one per route), hence the experts' shares,
    the load imbalance max share / mean share (1 = perfectly even), and the dead experts (zero slots);
  - the RMS of the shared and of the routed branch's contribution to the FFN output (after the fixed
    scale and the gate: what is added to the residual stream);
and at the logging step itself: the gate values, and the gradient norms of the shared expert, of the
routed experts and of each expert (w_in and w_out slices), read before clipping from the gradients as
they are after backward, i.e. already averaged over data-parallel ranks (never summed again).

Aggregates go to metrics.csv (imbalance: mean over layers; dead: summed over layers, so an expert dead
in one layer counts once there; RMS: mean over layers; grad norms: over all layers). Per-layer rows go to
telemetry.csv. Expert indices are per-layer labels (route tables differ by layer), so shares are never
summed across layers.

Under FSDP the expert and shared matrices' gradients are sharded: each rank sums the squares of its own
shards (the replicated gates count on rank 0 alone) and `collect` adds those partial sums over ranks in its
all-reduce, so every rank gets the figures of one process.

Cost: nothing when off (no hooks, no counters, no reductions). When on: per forward and layer one
bincount, a copy of the shared output and two sums of squares on the device, at each log step one
all-reduce (under DDP or FSDP) and one copy to the host. Only training forwards are counted (evaluation and
checkpoint recomputation are not).
"""

from __future__ import annotations

import contextlib
import math
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from trmoe.run.cadence import Cadence
from trmoe.run.columns import MetricColumn
from trmoe.runtime import env
from trmoe.runtime.parallel import is_dtensor, shard_region

LAYER_COLUMNS = (
    "step",
    "layer",
    "route_slots",  # route slots counted in this layer over the window (tokens x K, all ranks)
    "imbalance",  # max share / mean share
    "dead",  # experts with no route slot in the window
    "shared_rms",  # RMS of the shared branch's contribution to the FFN output
    "routed_rms",  # RMS of the routed branch's contribution to the FFN output
    "shared_gate",
    "routed_gate",
    "grad_norm_shared",  # shared expert matrices and gate
    "grad_norm_routed",  # routed expert tensors and gate
)


def telemetry_columns(num_experts: int) -> tuple[str, ...]:
    experts = range(num_experts)
    return LAYER_COLUMNS + tuple(f"share_{e}" for e in experts) + tuple(f"grad_norm_{e}" for e in experts)


class MoETelemetry:
    """Counters on the device, filled by forward hooks while `recording()` is active."""

    def __init__(self, model: torch.nn.Module, device: torch.device):
        self.ffns = [block.ffn for block in model.blocks]
        self.num_experts = model.spec.num_experts
        layers = len(self.ffns)
        dtype = env.sum_dtype(device)
        self.counts = torch.zeros(layers, self.num_experts, dtype=dtype, device=device)
        self.sumsq = torch.zeros(layers, 2, dtype=dtype, device=device)  # [shared, routed]
        self.numel = torch.zeros(layers, 2, dtype=dtype, device=device)
        self._recording = False
        self._sharded = False  # the last grad_norms() saw sharded (FSDP) gradients: collect() sums them
        self._handles = []
        # the hooks run eagerly inside a compiled model: disabled here, not decorated, so that importing this
        # module does not load dynamo
        shared_hook = torch.compiler.disable(self._shared_hook)
        routed_hook = torch.compiler.disable(self._routed_hook)
        for layer, ffn in enumerate(self.ffns):
            if ffn.shared is not None:
                self._handles.append(ffn.shared.register_forward_hook(partial(shared_hook, layer)))
            if ffn.routed is not None:
                self._handles.append(ffn.routed.register_forward_hook(partial(routed_hook, layer)))
        # The FFN sums its routed rows into the shared output in place (moe.py), so the routed hook sees
        # shared + routed: the routed part is that minus a copy of the shared output, taken as it is made.
        # Watching must not change what is computed (the same floating-point sums, telemetry on or off).
        self._shared_out: dict[int, torch.Tensor] = {}

    @contextlib.contextmanager
    def recording(self):
        """Count the forwards inside (the training forwards; not evaluation, not recomputation)."""
        self._recording = True
        try:
            yield
        finally:
            self._recording = False

    def _packed(self) -> torch.Tensor:
        return torch.cat([self.counts.flatten(), self.sumsq.flatten(), self.numel.flatten()])

    def state_dict(self) -> dict[str, Any]:
        """The open window's counters summed over ranks (one all-reduce when distributed): a checkpoint
        taken between two logged steps, resumed with any number of ranks, logs the same next row."""
        packed = self._packed()
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(packed)
        return {"window": packed.cpu().tolist()}

    def load_state_dict(self, state: dict[str, Any], rank: int) -> None:
        """The saved window on rank 0 (`collect` sums the ranks), zeros elsewhere."""
        self.reset()
        if rank == 0:
            packed = torch.tensor(state["window"], dtype=self.counts.dtype, device=self.counts.device)
            layers, e = len(self.ffns), self.num_experts
            self.counts.copy_(packed[: layers * e].view(layers, e))
            self.sumsq.copy_(packed[layers * e : layers * (e + 2)].view(layers, 2))
            self.numel.copy_(packed[layers * (e + 2) :].view(layers, 2))

    def reset(self) -> None:
        """An empty window (a rollback's replay starts one at the checkpoint's step)."""
        self.counts.zero_()
        self.sumsq.zero_()
        self.numel.zero_()
        self._shared_out.clear()

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._shared_out.clear()

    def _shared_hook(self, layer: int, module, inputs, output) -> None:
        if not self._recording:
            return
        # the output already carries the branch's gate x scale (folded into its output weight)
        self.sumsq[layer, 0] += output.detach().pow(2).sum(dtype=self.sumsq.dtype)
        self.numel[layer, 0] += output.numel()
        if self.ffns[layer].routed is not None:  # the routed rows are added into this very tensor next
            self._shared_out[layer] = output.detach().clone()

    def _routed_hook(self, layer: int, module, inputs, output) -> None:
        if not self._recording:
            return
        token_ids = inputs[1]
        routes = module.routes(token_ids).long()  # the table's, or what a learned router chose
        self.counts[layer] += torch.bincount(routes, minlength=self.num_experts).to(self.counts.dtype)
        # the routed module's output already carries the branch's gate x scale (folded into its activation)
        routed = output.detach()
        shared = self._shared_out.pop(layer, None)
        if shared is not None:  # shared + routed, summed in place: the routed part to rounding (~1e-7)
            routed = routed - shared.view_as(routed)
        self.sumsq[layer, 1] += routed.pow(2).sum(dtype=self.sumsq.dtype)
        self.numel[layer, 1] += routed.numel()

    @torch.no_grad()
    def grad_norms(self) -> torch.Tensor:
        """[L, 2 + E] on the device: squared grad norms of shared, routed, and each expert. Call after
        backward and before clipping (the values are the averaged gradients DDP leaves in .grad).
        With sharded (FSDP) gradients it is this rank's part: the sums over its shards, plus the replicated
        gates on rank 0; `collect` adds the parts over ranks."""
        out = self.counts.new_zeros(len(self.ffns), 2 + self.num_experts)
        self._sharded = any(is_dtensor(p.grad) for ffn in self.ffns for p in ffn.parameters())
        counted_here = not self._sharded or dist.get_rank() == 0  # where a replicated gradient counts

        def sq(t: torch.Tensor | None, dims=None) -> torch.Tensor | float:
            if t is None or t.grad is None:
                return 0.0
            if not is_dtensor(t.grad):
                if not counted_here:
                    return 0.0
                g = t.grad.to(out.dtype)
                return g.pow(2).sum() if dims is None else g.pow(2).sum(dim=dims)
            if not _shard_counted_here(t.grad):
                return 0.0
            g = t.grad.to_local().to(out.dtype)
            if dims is None:
                return g.pow(2).sum()
            part = g.new_zeros(t.shape[0])  # per expert (dim 0), this shard's rows in their global place
            part[shard_region(t.grad)[0]] = g.pow(2).sum(dim=dims)
            return part

        for layer, ffn in enumerate(self.ffns):
            if ffn.shared is not None:
                out[layer, 0] += sq(ffn.shared.w_in) + sq(ffn.shared.w_out) + sq(ffn.shared_gate)
            if ffn.routed is not None:
                out[layer, 2:] += sq(ffn.routed.w_in, (1, 2)) + sq(ffn.routed.w_out, (1, 2))
                out[layer, 1] += out[layer, 2:].sum() + sq(ffn.routed_gate)
        return out

    def collect(self, step: int, grad_sq: torch.Tensor | None) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """(aggregate metrics columns, per-layer telemetry rows) of the window; resets the counters.
        Under DDP the counters are summed over ranks here: one all-reduce per log row, nothing else (under
        FSDP the same one also sums the ranks' parts of `grad_sq`)."""
        layers, e = len(self.ffns), self.num_experts
        partial = grad_sq is not None and self._sharded
        packed = torch.cat([self._packed(), grad_sq.flatten()]) if partial else self._packed()
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(packed)
        packed = packed.cpu()
        counts = packed[: layers * e].view(layers, e)
        sumsq = packed[layers * e : layers * (e + 2)].view(layers, 2)
        numel = packed[layers * (e + 2) : layers * (e + 4)].view(layers, 2)
        if partial:
            grad_sq = packed[layers * (e + 4) :].view(layers, 2 + e)
        grads = grad_sq.cpu().sqrt() if grad_sq is not None else None
        self.reset()

        rows = []
        for layer, ffn in enumerate(self.ffns):
            c = counts[layer]
            total = float(c.sum())
            row: dict[str, Any] = {"step": step, "layer": layer, "route_slots": int(total)}
            if ffn.routed is not None and total > 0:
                shares = c / total
                row["imbalance"] = float(shares.max() * e)  # max / mean, mean share = 1/E
                row["dead"] = int((c == 0).sum())
                row.update({f"share_{i}": float(shares[i]) for i in range(e)})
            for i, branch in enumerate(("shared", "routed")):
                if numel[layer, i] > 0:
                    row[f"{branch}_rms"] = math.sqrt(float(sumsq[layer, i] / numel[layer, i]))
            row["shared_gate"] = None if ffn.shared_gate is None else float(ffn.shared_gate.detach())
            row["routed_gate"] = None if ffn.routed_gate is None else float(ffn.routed_gate.detach())
            if grads is not None:
                if ffn.shared is not None:
                    row["grad_norm_shared"] = float(grads[layer, 0])
                if ffn.routed is not None:
                    row["grad_norm_routed"] = float(grads[layer, 1])
                    row.update({f"grad_norm_{i}": float(grads[layer, 2 + i]) for i in range(e)})
            rows.append(row)

        def mean(key: str) -> float | None:
            values = [r[key] for r in rows if r.get(key) is not None]
            return sum(values) / len(values) if values else None

        dead = [r["dead"] for r in rows if "dead" in r]
        aggregate: dict[str, Any] = {
            "expert_imbalance": mean("imbalance"),
            "expert_dead": sum(dead) if dead else None,
            "shared_rms": mean("shared_rms"),
            "routed_rms": mean("routed_rms"),
        }
        if grads is not None:
            for i, branch in enumerate(("shared", "routed")):
                present = any(r.get(f"grad_norm_{branch}") is not None for r in rows)
                aggregate[f"grad_norm_{branch}"] = float(grads[:, i].pow(2).sum().sqrt()) if present else None
        return aggregate, rows


class TelemetryObserver:
    """Expert telemetry as an observer of the run: it counts the training forwards (`recording`), reads the
    gradient norms before clipping at the steps of its cadence (the log steps), and gives each metrics row
    its aggregate columns and the telemetry.csv rows of the same step (`collect`), which the run's one row
    sink (RunOutput) writes. Its state is the open window (a checkpoint component, "telemetry"). A metrics
    producer (trmoe.run.columns): its columns are in every run's metrics.csv, nan when telemetry is off."""

    COLUMNS = (
        MetricColumn(
            "expert_imbalance",
            "1",
            "moe/imbalance",
            "telemetry.moe: max share / mean share of route slots, mean over layers",
            slot=19,
        ),
        MetricColumn(
            "expert_dead",
            "experts",
            "moe/dead",
            "telemetry.moe: experts with no route slot in the window, summed over layers",
            slot=20,
        ),
        MetricColumn(
            "shared_rms",
            "1",
            "moe/shared_rms",
            "telemetry.moe: RMS of the shared branch's output contribution, mean over layers",
            slot=21,
        ),
        MetricColumn(
            "routed_rms",
            "1",
            "moe/routed_rms",
            "telemetry.moe: RMS of the routed branch's output contribution, mean over layers",
            slot=22,
        ),
        MetricColumn(
            "grad_norm_shared",
            "1",
            "optim/grad_norm_shared",
            "telemetry.moe: grad norm of the shared experts (all layers), before clipping",
            slot=23,
        ),
        MetricColumn(
            "grad_norm_routed",
            "1",
            "optim/grad_norm_routed",
            "telemetry.moe: grad norm of the routed experts (all layers), before clipping",
            slot=24,
        ),
    )

    def __init__(self, model: torch.nn.Module, device: torch.device, cadence: Cadence, rank: int = 0):
        self.moe = MoETelemetry(model, device)
        self.num_experts = self.moe.num_experts
        self.cadence, self.rank = cadence, rank
        self._grad_sq: torch.Tensor | None = None
        self.layers: list[dict[str, Any]] = []  # the telemetry.csv rows of the last `row`

    def columns_declared(self) -> tuple[MetricColumn, ...]:
        return self.COLUMNS

    def row(self, step: int, row) -> dict[str, Any]:
        """The aggregate metrics columns of the window (its telemetry.csv rows: `layers`)."""
        aggregate, self.layers = self.collect(step)
        return aggregate

    def recording(self):
        return self.moe.recording()

    def before_clip(self, step: int) -> None:
        """After backward, before clipping: the gradient norms of a logged step."""
        if self.cadence.due(step):
            self._grad_sq = self.moe.grad_norms()

    def collect(self, step: int) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """(aggregate metrics columns, telemetry.csv rows) of the window; starts the next one."""
        grad_sq, self._grad_sq = self._grad_sq, None
        return self.moe.collect(step, grad_sq)

    def state_dict(self) -> dict[str, Any]:
        return self.moe.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The checkpoint's open window (a resume, a rollback's replay)."""
        self._grad_sq = None
        self.moe.load_state_dict(state, self.rank)

    def rewind(self) -> None:
        """A rollback: an empty window (the checkpoint's, if it has one, is loaded next)."""
        self._grad_sq = None
        self.moe.reset()

    def close(self) -> None:
        self.moe.remove()


def _shard_counted_here(g: torch.Tensor) -> bool:
    """Whether this rank's shard of the DTensor `g` is in the sum over all ranks: the collective spans the
    world, so a shard replicated over some mesh dimension counts only at coordinate 0 there."""
    mesh = g.device_mesh
    if mesh.size() != dist.get_world_size():
        raise NotImplementedError(f"telemetry: gradients on a {mesh} that is not the whole world")
    return all(mesh.get_local_rank(i) == 0 for i, p in enumerate(g.placements) if p.is_replicate())
