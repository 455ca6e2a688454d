"""Forward, recompute and backward of one decoder layer under its activation policy.

The policies are slidedp.spec.segments' ("layer", "none", "sac", "seg:0bMMMMMMM"); what they keep
goes to the layer's KeptActivations entries (activations.py), which offload ratio r of it.

    "layer"   forward without autograd; recompute re-runs the HF layer with autograd from x (as
              ModelRunner.layer_forward); backward is one autograd.grad through it.
    the rest  ONE autograd graph per (layer, micro-batch), built by the forward, kept until the
              backward, back-propagated by ONE autograd.grad. The layer runs as segment_layer's
              pieces (the HF layer's own ops, in its order), or as the HF layer itself where the
              policy recomputes nothing; a policy is a PiecePlan: the pieces it recomputes, and
              the values it keeps besides what autograd saves (the inputs of recomputed pieces
              that no recomputed piece produces: what the recompute starts from)
                seg:mask  recomputes the pieces of segment s < 7 iff boundary s is not kept; keeps
                          x and the kept boundaries a recomputed piece reads
                none      = seg:0b1111111: recomputes nothing, keeps what autograd saves (and x)
                sac       recomputes input_norm, qk_norm_rope, o_copy, post_norm, act_mul (the
                          memory-bound ops); keeps x, q_pre, k_pre, o, h1, g, u (v, o's logsumexp
                          are saved by attention)
              Forward: every piece with autograd, from x entered through an _Entry node (a graph
              input that holds no tensor), under saved_tensors_hooks whose pack decides what
              each saved tensor becomes:
                parameter slot, RoPE table,   the tensor itself (a reference: the slot holds the
                packed rows' mask, another    layer's parameters again at its backward; SDPA's
                device's tensor, an empty     RNG state may be a host or an empty tensor)
                storage
                saved inside a recomputed     a _Saved(piece, i) placeholder: the i-th tensor the
                piece                         piece saves (recompute saves the same ones again)
                a recomputed piece's output   a _Placeholder of that value (and view geometry)
                (seen by a kept piece)
                anything else                 a kept entry (KeptActivations.add: a reference to
                                              its storage, or its offloaded part)
              so after the forward the layer holds exactly its kept entries (the graph holds
              GradientEdges of x's _Entry and of the output, and the parameter leaves).
              Recompute re-runs the recomputed pieces with autograd from kept values and earlier
              recomputed ones, recording the tensors each saves (same ops, same order; their
              graph is dropped): unpack then returns them for the forward's placeholders.
              Backward: one autograd.grad from the output to x and the parameters; autograd sums
              the gradients of x and h1 over their two consumers as it does for the HF layer.
Kept tensors are references, not copies (activations.py): the only per-step copies are the
offloaded parts (ACT_OFFLOAD, ACT_RELOAD) and, for the one entry that straddles the offload split,
its resident tail and its join in backward.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge, saved_tensors_hooks

from slidedp.exec.activations import Kept, KeptActivations
from slidedp.exec.layer_runner import Attention, ModelRunner, PerMicroBatch
from slidedp.exec.segment_layer import PIECES, SegmentLayer
from slidedp.spec.segments import ALL_KEPT, LayerPolicy, recomputed_segments

SAC_RECOMPUTED = frozenset({"input_norm", "qk_norm_rope", "o_copy", "post_norm", "act_mul"})


@dataclass(frozen=True)
class PiecePlan:
    """What a (non-"layer") policy recomputes (piece names) and keeps besides what autograd saves
    (value names: x and the inputs of recomputed pieces that no recomputed piece produces)."""

    recomputed: frozenset[str]
    kept: tuple[str, ...]


def _leaves(params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The slot's parameters as autograd leaves (views of the slot, no copy)."""
    return {k: p.detach().requires_grad_() for k, p in params.items()}


@functools.cache
def piece_plan(p: LayerPolicy) -> PiecePlan:
    if p.kind == "sac":
        redo = SAC_RECOMPUTED
    else:
        mask = ALL_KEPT if p.kind == "none" else p.mask
        segs = set(recomputed_segments(LayerPolicy("seg", mask)))
        redo = frozenset(pc.name for pc in PIECES if pc.segment in segs)
    made = {n for pc in PIECES if pc.name in redo for n in pc.outputs}
    kept = ["x"]
    for pc in PIECES:
        if pc.name in redo:
            kept += [n for n in pc.inputs if n not in made and n not in kept]
    return PiecePlan(redo, tuple(kept))


def recomputes(p: LayerPolicy) -> bool:
    """Whether the policy re-runs anything in backward (the graph's RECOMPUTE task exists)."""
    return p.kind == "layer" or bool(piece_plan(p).recomputed)


class _Entry(torch.autograd.Function):
    """The layer input as a graph node that holds no tensor (so it can be released). Its output
    shares x's storage but is no autograd view of it: a view's grad_fn would be rebuilt (and
    refused) when another part of its base changes, as another slot of the reload buffer does."""

    @staticmethod
    def forward(ctx, anchor, x):
        return x.detach()

    @staticmethod
    def backward(ctx, grad):
        return None, None


@dataclass
class _Graph:
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


@dataclass(frozen=True)
class _Saved:
    """The i-th tensor autograd saves inside recomputed piece `piece` (recompute records it)."""

    piece: str
    i: int


@dataclass
class LayerState:
    """What one (layer, micro-batch) carries from forward to backward."""

    layer: int
    b: int
    policy: LayerPolicy
    graph: _Graph | None = None
    kept: dict[str, Kept] = field(default_factory=dict)
    n_saved: dict[str, int] = field(default_factory=dict)  # recomputed piece -> tensors it saves
    recomputed: dict[str, torch.Tensor] = field(default_factory=dict)  # filled by recompute
    saved: dict[str, list[torch.Tensor]] = field(default_factory=dict)  # filled by recompute
    ready: bool = False  # recompute done
    acts: KeptActivations | None = None  # where forward kept its tensors (recompute reads them)


class PolicyRunner:
    """Runs decoder layers under their policies; `acts` holds what they keep."""

    def __init__(self, runner: ModelRunner, acts: KeptActivations | None):
        self.runner, self.acts = runner, acts
        self.pieces = SegmentLayer(runner.layer, [e.local for e in runner.layouts[1].entries])
        self.anchor = torch.zeros((), device=runner.device, requires_grad=True)

    # ---- forward -------------------------------------------------------------------------------

    def forward(self, policy: LayerPolicy, layer: int, b: int, params, x: torch.Tensor,
                rope: Attention | PerMicroBatch, acts=None) -> tuple[torch.Tensor, LayerState]:
        """Layer `layer`'s output for micro-batch b (x already kept by the caller; `rope`: the
        step's attention inputs, rope.of(b) this micro-batch's); what it keeps goes to `acts`
        (default: the runner's)."""
        acts = acts or self.acts
        st = LayerState(layer, b, policy, acts=acts)
        attn = rope.of(b)
        if policy.kind == "layer":
            with torch.no_grad():
                return self.runner.layer_forward(params, x, attn), st
        plan = piece_plan(policy)
        through = {t.untyped_storage().data_ptr() for t in (*params.values(), *attn.tensors())}
        made_by_recompute: dict[int, tuple[str, int]] = {}  # storage -> (value, its offset)
        device = x.device
        running: list[str | None] = [None]  # the recomputed piece being run, else None

        def pack(t):
            piece = running[0]
            if piece is not None:
                i = st.n_saved[piece]
                st.n_saved[piece] = i + 1
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            if ptr in through or t.device != device or not storage.nbytes():
                return t
            if piece is not None:
                return _Saved(piece, i)
            if ptr in made_by_recompute:
                name, base = made_by_recompute[ptr]
                return _Placeholder(name, tuple(t.shape), t.stride(), t.storage_offset() - base)
            return acts.add(layer, b, t)

        def unpack(h):
            if isinstance(h, torch.Tensor):
                return h
            if isinstance(h, _Saved):
                return st.saved[h.piece][h.i]
            if isinstance(h, _Placeholder):
                v = st.recomputed[h.value]
                return v.as_strided(h.size, h.stride, v.storage_offset() + h.offset)
            return acts.tensor(h)

        leaves = _leaves(params)
        with torch.enable_grad(), saved_tensors_hooks(pack, unpack):
            entry = _Entry.apply(self.anchor, x)
            if not plan.recomputed:  # the HF layer itself: the same ops, one functional_call
                out = self.runner.layer_forward(leaves, entry, attn)
            else:
                values = {"x": entry}
                for pc in PIECES:
                    redo = pc.name in plan.recomputed
                    if redo:
                        running[0] = pc.name
                        st.n_saved[pc.name] = 0
                    outs = self.pieces.run(pc, leaves, [values[n] for n in pc.inputs], attn)
                    running[0] = None
                    values.update(zip(pc.outputs, outs, strict=True))
                    if redo:
                        made_by_recompute.update((o.untyped_storage().data_ptr(),
                                                  (n, o.storage_offset()))
                                                 for n, o in zip(pc.outputs, outs, strict=True))
                    for n in pc.outputs:
                        if n in plan.kept:
                            st.kept[n] = acts.add(layer, b, values[n].detach())
                out = values["out"]
        st.kept["x"] = acts.add(layer, b, x)
        st.graph = _Graph([get_gradient_edge(entry)], [get_gradient_edge(out)], leaves)
        return out.detach(), st

    # ---- recompute and backward ----------------------------------------------------------------

    def recompute(self, st: LayerState, params, rope) -> None:
        """Re-run what the policy recomputes, with autograd (once; BWD calls it again)."""
        if st.ready:
            return
        st.ready = True
        attn = rope.of(st.b)
        if st.policy.kind == "layer":
            leaves = _leaves(params)
            x = st.acts.input(st.layer, st.b).detach().requires_grad_()
            with torch.enable_grad():
                out = self.runner.layer_forward(leaves, x, attn)
            st.graph = _Graph([get_gradient_edge(x)], [get_gradient_edge(out)], leaves)
            return
        plan = piece_plan(st.policy)
        if not plan.recomputed:
            return
        leaves = _leaves(params)
        record: list[torch.Tensor] = []

        def pack(t):
            record.append(t.detach())

        def unpack(h):
            raise RuntimeError("the recompute's own graph is never back-propagated")

        with torch.enable_grad(), saved_tensors_hooks(pack, unpack):
            for pc in PIECES:
                if pc.name not in plan.recomputed:
                    continue
                ins = [(st.recomputed[n] if n in st.recomputed
                        else st.acts.tensor(st.kept[n])).detach().requires_grad_()
                       for n in pc.inputs]
                record = []
                outs = self.pieces.run(pc, leaves, ins, attn)
                if len(record) != st.n_saved[pc.name]:
                    raise RuntimeError(f"recomputing {pc.name} saved {len(record)} tensors, its "
                                       f"forward {st.n_saved[pc.name]}")
                st.saved[pc.name] = record
                st.recomputed.update(zip(pc.outputs, (o.detach() for o in outs), strict=True))

    def backward(self, st: LayerState, grad_out: torch.Tensor
                 ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(gradient of the layer input, parameter gradients by name) for micro-batch st.b."""
        g = st.graph
        got = torch.autograd.grad(g.outputs, [*g.inputs, *g.params.values()], [grad_out])
        st.graph = None
        st.saved.clear()
        st.recomputed.clear()
        return got[0], dict(zip(g.params, got[1:], strict=True))


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
