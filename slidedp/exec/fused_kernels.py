"""The kernels a plan's decoder layers and LM head run (plan.kernels, spec/plan.py Kernels).

    eager  transformers' own modules and loss.py's chunked linear + cross-entropy: the exact path,
           the only one off CUDA
    liger  liger-kernel's Triton kernels on CUDA: RMSNorm (every norm of a decoder layer, q/k norms
           included, and the final norm), the SwiGLU MLP's SiLU x up, RoPE, and the fused linear +
           cross-entropy for HEAD_LOSS
    auto   liger on a CUDA device where liger-kernel imports, else eager (`resolve` says why)

How the layers get them. `apply` patches the modules of the executor's own meta model
(ModelRunner's, one per runner), never the transformers classes: each RMSNorm and gated MLP gets an
instance `forward` that calls liger's function on the same parameters (functional_call swaps them
as before); `unpatch` deletes those instance attributes again. RoPE is the exception: attention
calls its modeling module's global `apply_rotary_pos_emb`, so `install_rope` replaces that global
with a dispatcher that calls liger's kernel for CUDA tensors and the original function for every
other tensor (CPU paths stay bit-identical). The dispatcher is process-wide: once a liger runner of
a family exists, every CUDA model of that family in the process rotates with liger's kernel (equal
within BF16 rounding); `restore` puts the original functions back. Patching twice, installing
twice and restoring twice are no-ops.

Two liger behaviours the executor must not meet:
  - liger's RoPE writes its result into the storage of q and k. In families without q/k norms
    those are views of the q/k projections' outputs, which policy sac keeps to recompute RoPE
    from (policy_runner.py): the dispatcher hands liger copies of q and k there. With q/k norms
    (qwen3) they are the norms' fresh outputs, which nothing else reads.
  - liger's RMSNorm can write its input gradient over the output gradient it is given (in_place):
    the norms run with in_place=False, as the executor's backward may hand a gradient it still
    reads.

HEAD_LOSS with liger (`liger_linear_cross_entropy`, same contract as loss.linear_cross_entropy):
liger's fused linear + cross-entropy with reduction "sum" and a class-weight vector equal to
`scale` for every class, so that loss = scale * sum_i CE_i and every logit's gradient is
scale * (softmax - onehot), computed in FP32 and rounded once to the compute dtype, as loss.py
does: exactly token-weighted over the global batch, whatever the micro-batch's own token count.
liger returns its own dW (vocab x hidden, compute dtype), which is added into grad_weight.
"""

from __future__ import annotations

import functools
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass

import torch

from slidedp.exec.loss import IGNORE_INDEX, linear_cross_entropy
from slidedp.spec.errors import SpecError
from slidedp.spec.plan import Kernels

ROPE_GLOBAL = "apply_rotary_pos_emb"
SWIGLU_ACTS = ("silu", "swish")


@dataclass(frozen=True)
class Fused:
    """The fused functions the patched modules call (liger's, or stand-ins in tests)."""

    rms_norm: Callable  # (x, weight, eps) -> weight * normalized x, as the HF RMSNorm
    silu_mul: Callable  # (gate, up) -> silu(gate) * up
    rope: Callable  # (q, k, cos, sin) -> (q, k) rotated, as the HF apply_rotary_pos_emb


@functools.cache
def liger_unavailable() -> str | None:
    """None where liger-kernel's functional API imports, else why not (one line)."""
    try:
        import liger_kernel.transformers.functional  # noqa: F401
    except Exception as e:  # ImportError, or triton failing to find a driver
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}".rstrip(": ")
    return None


def resolve(kernels: str, device: torch.device) -> tuple[str, str]:
    """(the kernels that run, "eager" or "liger"; why, in a few words). "liger" where it cannot
    run is a SpecError naming plan.kernels."""
    k = _kernels(kernels)
    cuda = torch.device(device).type == "cuda"
    if k == Kernels.EAGER:
        return "eager", "asked for"
    if not cuda:
        if k == Kernels.LIGER:
            raise SpecError("plan", "kernels", f"eager or auto on {torch.device(device).type}: "
                            "liger-kernel runs on CUDA devices only")
        return "eager", f"auto: the device is {torch.device(device).type}"
    why = liger_unavailable()
    if why is not None:
        if k == Kernels.LIGER:
            raise SpecError("plan", "kernels", f"eager or auto: liger-kernel does not import "
                            f"here ({why})")
        return "eager", f"auto: liger-kernel does not import ({why})"
    return "liger", "asked for" if k == Kernels.LIGER else "auto: CUDA with liger-kernel"


def _kernels(kernels: str) -> Kernels:
    try:
        return Kernels(kernels)
    except ValueError:
        raise SpecError("plan", "kernels", f"one of {', '.join(k.value for k in Kernels)}, got "
                        f"{kernels!r}") from None


def liger() -> Fused:
    """liger-kernel's functions (import it only where resolve() said liger)."""
    from liger_kernel.transformers import functional as lf

    def rms_norm(x, weight, eps):
        return lf.liger_rms_norm(x, weight, eps, offset=0.0, casting_mode="llama", in_place=False)

    return Fused(rms_norm, lf.liger_swiglu, lf.liger_rope)


def apply(model: torch.nn.Module, kernels: str, device: torch.device) -> tuple[str, str]:
    """Resolve `kernels` on `device`; for liger, patch `model` (a *ForCausalLM, typically on the
    meta device) and install the RoPE dispatcher of its family. Returns resolve()'s pair."""
    name, why = resolve(kernels, device)
    if name == "liger":
        fused = liger()
        patch(model, fused)
        attn = model.model.layers[0].self_attn
        install_rope(sys.modules[type(attn).__module__], fused.rope,
                     copy_inputs=not hasattr(attn, "q_norm"))
    return name, why


def head_loss(kernels: str) -> Callable:
    """HEAD_LOSS's linear + cross-entropy for resolved `kernels` (loss.linear_cross_entropy's
    signature and contract)."""
    return liger_linear_cross_entropy if kernels == "liger" else linear_cross_entropy


# ---- module patches -------------------------------------------------------------------------


def _rms_norm_forward(fused: Fused, self, x):
    return fused.rms_norm(x, self.weight, self.variance_epsilon)


def _swiglu_forward(fused: Fused, self, x):
    return self.down_proj(fused.silu_mul(self.gate_proj(x), self.up_proj(x)))


def patched_modules(model: torch.nn.Module) -> list[tuple[torch.nn.Module, Callable]]:
    """(module, its fused forward taking (fused, self, x)) for every RMSNorm of the model's
    decoder and every gated MLP with a SiLU activation."""
    out = []
    for m in model.model.modules():
        if type(m).__name__.endswith("RMSNorm") and hasattr(m, "variance_epsilon"):
            out.append((m, _rms_norm_forward))
        elif all(hasattr(m, a) for a in ("gate_proj", "up_proj", "down_proj")) and getattr(
                getattr(m, "config", None), "hidden_act", None) in SWIGLU_ACTS:
            out.append((m, _swiglu_forward))
    return out


def patch(model: torch.nn.Module, fused: Fused) -> int:
    """Give every module of patched_modules() an instance forward calling `fused`; returns how
    many. Idempotent (a second call rebinds the same forward)."""
    mods = patched_modules(model)
    for m, fwd in mods:
        m.forward = types.MethodType(functools.partial(fwd, fused), m)
    return len(mods)


def unpatch(model: torch.nn.Module) -> None:
    """Remove the instance forwards patch() set (the class's forward runs again)."""
    for m, _ in patched_modules(model):
        m.__dict__.pop("forward", None)


# ---- the RoPE dispatcher (process-wide) -----------------------------------------------------

_ORIGINAL_ROPE: dict[str, Callable] = {}


def install_rope(module: types.ModuleType, rope: Callable, copy_inputs: bool,
                 on: Callable[[torch.Tensor], bool] = lambda t: t.is_cuda) -> None:
    """Replace `module`'s apply_rotary_pos_emb by a dispatcher: `rope` for tensors where `on`
    holds (CUDA), the original function for the rest; with `copy_inputs`, `rope` gets copies of
    q and k (it writes into its inputs). Installed once per module; see the module docstring."""
    if module.__name__ in _ORIGINAL_ROPE:
        return
    original = getattr(module, ROPE_GLOBAL)

    def dispatch(q, k, cos, sin, *args, **kwargs):
        if not on(q):
            return original(q, k, cos, sin, *args, **kwargs)
        if copy_inputs:
            q, k = q.clone(), k.clone()
        return rope(q, k, cos, sin, *args, **kwargs)

    _ORIGINAL_ROPE[module.__name__] = original
    setattr(module, ROPE_GLOBAL, dispatch)


def restore() -> None:
    """Put back every original apply_rotary_pos_emb install_rope replaced."""
    while _ORIGINAL_ROPE:
        name, original = _ORIGINAL_ROPE.popitem()
        setattr(sys.modules[name], ROPE_GLOBAL, original)


# ---- HEAD_LOSS ------------------------------------------------------------------------------


def liger_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    scale: float,
    grad_weight: torch.Tensor,
    chunk_tokens: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """loss.linear_cross_entropy through liger's fused kernel (module docstring); liger picks its
    own chunk size, so `chunk_tokens` is accepted and unused."""
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    h = hidden.detach().requires_grad_()
    w = weight.detach().requires_grad_()
    class_scale = torch.full((weight.shape[0],), scale, dtype=torch.float32, device=hidden.device)
    with torch.enable_grad():
        loss = liger_fused_linear_cross_entropy(h, w, targets, ce_weight=class_scale,
                                                ignore_index=IGNORE_INDEX, reduction="sum")
        grad_hidden, grad_w = torch.autograd.grad(loss, (h, w))
    grad_weight += grad_w
    return loss.detach().float(), grad_hidden
