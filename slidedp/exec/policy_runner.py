"""Forward, recompute and backward of one decoder layer under its activation policy.

The policies are slidedp.spec.segments' ("layer", "none", "sac", "seg:0bMMMMMMM"); what they keep
goes to the layer's KeptActivations entries (activations.py), which offload ratio r of it.

    "layer"   forward without autograd; recompute re-runs the HF layer with autograd from x (as
              ModelRunner.layer_forward); backward is one autograd.grad through it.
    the rest  the layer as segment_layer's pieces. A policy is a PiecePlan: the pieces it
              recomputes and the values it keeps besides what autograd saves:
                seg:mask  recomputes the pieces of segment s < 7 iff boundary s is not kept;
                          keeps x and the kept boundaries (BOUNDARY_VALUES)
                none      = seg:0b1111111: recomputes nothing
                sac       recomputes input_norm, qk_norm_rope, o_copy, post_norm, act_mul (the
                          memory-bound ops); keeps x, q_pre, k_pre, v, o, h1, g, u
              Forward runs every piece in order: a recomputed one without autograd, the others
              with it, each from its inputs entered through an _Entry node (a graph input that
              holds no tensor) under saved_tensors_hooks: a saved tensor whose storage is a
              parameter slot or the RoPE table is kept by reference, one produced by a recomputed
              piece is replaced by a placeholder (recompute brings it back), any other becomes a
              kept entry. Only GradientEdges of a piece's inputs and outputs are held, so after
              the forward the layer holds exactly its kept entries. Recompute re-runs the
              recomputed pieces with autograd, from kept values and earlier recomputed ones.
              Backward walks the pieces from last to first, one autograd.grad each, the gradient
              of a value summed over its consumers (x and h1 have two: a sum of two terms, the
              same as autograd's for the HF layer, so gradients equal ModelRunner's).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge, saved_tensors_hooks

from slidedp.exec.activations import Kept, KeptActivations
from slidedp.exec.layer_runner import ModelRunner
from slidedp.exec.segment_layer import BOUNDARY_VALUES, PIECES, SegmentLayer
from slidedp.spec.segments import ALL_KEPT, LayerPolicy, recomputed_segments

SAC_RECOMPUTED = frozenset({"input_norm", "qk_norm_rope", "o_copy", "post_norm", "act_mul"})
SAC_KEPT = ("x", "q_pre", "k_pre", "v", "o", "h1", "g", "u")


@dataclass(frozen=True)
class PiecePlan:
    """What a (non-"layer") policy recomputes (piece names) and keeps (value names)."""

    recomputed: frozenset[str]
    kept: tuple[str, ...]


def piece_plan(p: LayerPolicy) -> PiecePlan:
    if p.kind == "sac":
        return PiecePlan(SAC_RECOMPUTED, SAC_KEPT)
    mask = ALL_KEPT if p.kind == "none" else p.mask
    redo = set(recomputed_segments(LayerPolicy("seg", mask)))
    kept = ("x",) + tuple(v for i, vs in enumerate(BOUNDARY_VALUES) if mask >> i & 1 for v in vs)
    return PiecePlan(frozenset(pc.name for pc in PIECES if pc.segment in redo), kept)


def recomputes(p: LayerPolicy) -> bool:
    """Whether the policy re-runs anything in backward (the graph's RECOMPUTE task exists)."""
    return p.kind == "layer" or bool(piece_plan(p).recomputed)


class _Entry(torch.autograd.Function):
    """A piece's input as a graph node that holds no tensor (so it can be released). Its output
    shares x's storage but is no autograd view of it: a view's grad_fn would be rebuilt (and
    refused) when another part of its base changes, as another slot of the reload buffer does."""

    @staticmethod
    def forward(ctx, anchor, x):
        return x.detach()

    @staticmethod
    def backward(ctx, grad):
        return None, None


@dataclass
class _PieceGraph:
    inputs: list[GradientEdge]
    outputs: list[GradientEdge]
    params: dict[str, torch.Tensor]  # leaves (views of the slot)


@dataclass(frozen=True)
class _Placeholder:
    """A saved tensor produced by a recomputed piece: `value` seen as (size, stride, offset
    from the value's own storage offset: a recomputed value may be a view of a kept one, as
    o_flat is of o when o.transpose(1, 2) is contiguous already, and that one may be reloaded)."""

    value: str
    size: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int


@dataclass
class LayerState:
    """What one (layer, micro-batch) carries from forward to backward."""

    layer: int
    b: int
    policy: LayerPolicy
    graphs: dict[str, _PieceGraph] = field(default_factory=dict)
    kept: dict[str, Kept] = field(default_factory=dict)
    recomputed: dict[str, torch.Tensor] = field(default_factory=dict)  # filled by recompute
    ready: bool = False  # recompute done


class PolicyRunner:
    """Runs decoder layers under their policies; `acts` holds what they keep."""

    def __init__(self, runner: ModelRunner, acts: KeptActivations | None):
        self.runner, self.acts = runner, acts
        self.pieces = SegmentLayer(runner.layer, [e.local for e in runner.layouts[1].entries])
        self.anchor = torch.zeros((), device=runner.device, requires_grad=True)

    # ---- forward -------------------------------------------------------------------------------

    def forward(self, policy: LayerPolicy, layer: int, b: int, params, x: torch.Tensor,
                rope, acts=None) -> tuple[torch.Tensor, LayerState]:
        """Layer `layer`'s output for micro-batch b (x already kept by the caller); what it keeps
        goes to `acts` (default: the runner's)."""
        acts = acts or self.acts
        st = LayerState(layer, b, policy)
        if policy.kind == "layer":
            with torch.no_grad():
                return self.runner.layer_forward(params, x, rope), st
        plan = piece_plan(policy)
        through = {t.untyped_storage().data_ptr() for t in (*params.values(), *rope)}
        made_by_recompute: dict[int, tuple[str, int]] = {}  # storage -> (value, its offset)

        def pack(t):
            ptr = t.untyped_storage().data_ptr()
            if ptr in through:
                return t
            if ptr in made_by_recompute:
                name, base = made_by_recompute[ptr]
                return _Placeholder(name, tuple(t.shape), t.stride(), t.storage_offset() - base)
            return acts.add(layer, b, t)

        def unpack(h):
            if isinstance(h, torch.Tensor):
                return h
            if isinstance(h, _Placeholder):
                v = st.recomputed[h.value]
                return v.as_strided(h.size, h.stride, v.storage_offset() + h.offset)
            return self.acts.tensor(h)

        values = {"x": x}
        for pc in PIECES:
            ins = [values[n] for n in pc.inputs]
            if pc.name in plan.recomputed:
                with torch.no_grad():
                    outs = self.pieces.run(pc, params, ins, rope)
                made_by_recompute.update((o.untyped_storage().data_ptr(), (n, o.storage_offset()))
                                         for n, o in zip(pc.outputs, outs, strict=True))
            else:
                with torch.enable_grad(), saved_tensors_hooks(pack, unpack):
                    st.graphs[pc.name], outs = self._graph(pc, params, ins, rope)
            values.update(zip(pc.outputs, (o.detach() for o in outs), strict=True))
            for n in pc.outputs:
                if n in plan.kept:
                    st.kept[n] = acts.add(layer, b, values[n])
        st.kept["x"] = acts.add(layer, b, x)
        return values["out"], st

    def _graph(self, pc, params, ins, rope) -> tuple[_PieceGraph, tuple[torch.Tensor, ...]]:
        leaves = {n: params[n].detach().requires_grad_() for n in self.pieces.params_of[pc.name]}
        entries = [_Entry.apply(self.anchor, t) for t in ins]
        outs = self.pieces.run(pc, leaves, entries, rope)
        return _PieceGraph([get_gradient_edge(e) for e in entries],
                           [get_gradient_edge(o) for o in outs], leaves), outs

    # ---- recompute and backward ----------------------------------------------------------------

    def recompute(self, st: LayerState, params, rope) -> None:
        """Re-run what the policy recomputes, with autograd (once; BWD calls it again)."""
        if st.ready:
            return
        st.ready = True
        if st.policy.kind == "layer":
            leaves = {k: p.detach().requires_grad_() for k, p in params.items()}
            x = self.acts.input(st.layer, st.b).detach().requires_grad_()
            with torch.enable_grad():
                out = self.runner.layer_forward(leaves, x, rope)
            st.graphs["layer"] = _PieceGraph([get_gradient_edge(x)], [get_gradient_edge(out)],
                                             leaves)
            return
        plan = piece_plan(st.policy)
        for pc in PIECES:
            if pc.name not in plan.recomputed:
                continue
            ins = [st.recomputed[n] if n in st.recomputed else self.acts.tensor(st.kept[n])
                   for n in pc.inputs]
            with torch.enable_grad():
                st.graphs[pc.name], outs = self._graph(pc, params, ins, rope)
            st.recomputed.update(zip(pc.outputs, (o.detach() for o in outs), strict=True))

    def backward(self, st: LayerState, grad_out: torch.Tensor
                 ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(gradient of the layer input, parameter gradients by name) for micro-batch st.b."""
        if st.policy.kind == "layer":
            g = st.graphs["layer"]
            got = torch.autograd.grad(g.outputs, [*g.inputs, *g.params.values()], [grad_out])
            return got[0], dict(zip(g.params, got[1:], strict=True))
        grads: dict[str, torch.Tensor] = {"out": grad_out}
        pgrads: dict[str, torch.Tensor] = {}
        for pc in reversed(PIECES):
            g = st.graphs[pc.name]
            got = torch.autograd.grad(g.outputs, [*g.inputs, *g.params.values()],
                                      [grads.pop(n) for n in pc.outputs])
            for n, gi in zip(pc.inputs, got[:len(pc.inputs)], strict=True):
                grads[n] = grads[n] + gi if n in grads else gi
            pgrads.update(zip(g.params, got[len(pc.inputs):], strict=True))
        return grads["x"], pgrads


def kept_layout(runner: PolicyRunner, policy: LayerPolicy, params, x: torch.Tensor,
                rope) -> tuple[int, ...]:
    """The entry sizes (bytes) a layer of `policy` keeps for one micro-batch of x's shape: one
    forward on the device, the kept entries counted instead of kept (values are irrelevant)."""
    if policy.kind == "layer":
        return (x.untyped_storage().nbytes(),)
    sizes: dict[int, int] = {}
    held: list[torch.Tensor] = []  # alive until the end: no storage address is reused

    class _Count:
        def add(self, layer, b, t):
            held.append(t)
            sizes.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())

    count = _Count()
    count.add(1, 0, x)
    runner.forward(policy, 1, 0, params, x, rope, acts=count)
    return tuple(sizes.values())
