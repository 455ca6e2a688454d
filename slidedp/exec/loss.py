"""Chunked linear + cross-entropy: the LM head and loss without the full tokens x vocab logits.

For hidden states H (T x h), head weight W (V x h) and targets y (T, -100 = ignored), the loss is
    loss = scale * sum_{i: y_i != -100} (logsumexp_j z_ij - z_{i y_i}),   z = H W^T  (FP32)
with scale = 1 / (non-ignored tokens of the global batch) as in Hugging Face's ForCausalLMLoss.
Forward and backward run together, `chunk_tokens` rows at a time, so at most one chunk's FP32
logits and their gradient exist (memory.py's `loss` term):
    dz = scale * (softmax(z) - onehot(y)) on non-ignored rows, 0 elsewhere
    dH = dz W,   dW += dz^T H
Logits are computed in the input dtype and upcast to FP32, as transformers does.
`cross_entropy_sum` is the forward alone (eval loss): the unscaled sum, chunk by chunk.
"""

from __future__ import annotations

import torch

from slidedp.spec.elements import LOSS_CHUNK_TOKENS

IGNORE_INDEX = -100


def shift_labels(labels: torch.Tensor) -> torch.Tensor:
    """Targets per position: labels shifted left by one, the last position ignored (as HF does)."""
    pad = torch.full_like(labels[..., :1], IGNORE_INDEX)
    return torch.cat([labels[..., 1:], pad], dim=-1)


def _chunk_loss(h: torch.Tensor, weight: torch.Tensor, y: torch.Tensor):
    """(FP32 logits z, valid, y with ignored targets at 0, per-token loss: 0 where ignored)."""
    valid = y != IGNORE_INDEX
    y_safe = torch.where(valid, y, 0)
    z = (h @ weight.T).float()
    lse = torch.logsumexp(z, dim=-1)
    picked = z.gather(1, y_safe[:, None]).squeeze(1)
    return z, valid, y_safe, picked, torch.where(valid, lse - picked, 0.0)


@torch.no_grad()
def cross_entropy_sum(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                      chunk_tokens: int = LOSS_CHUNK_TOKENS) -> torch.Tensor:
    """The loss summed over the non-ignored targets (0-dim FP32), forward only."""
    loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
    for lo in range(0, hidden.shape[0], chunk_tokens):
        loss += _chunk_loss(hidden[lo:lo + chunk_tokens], weight,
                            targets[lo:lo + chunk_tokens])[-1].sum()
    return loss


@torch.no_grad()
def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    scale: float,
    grad_weight: torch.Tensor,
    chunk_tokens: int = LOSS_CHUNK_TOKENS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(scaled loss sum as a 0-dim FP32 tensor, dL/dhidden); adds dL/dW into `grad_weight`.

    hidden (T, h), weight (V, h), targets (T,) int64, grad_weight (V, h) in weight's dtype.
    """
    loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
    grad_hidden = torch.empty_like(hidden)
    for lo in range(0, hidden.shape[0], chunk_tokens):
        h = hidden[lo : lo + chunk_tokens]
        z, valid, y_safe, picked, token_loss = _chunk_loss(h, weight, targets[lo : lo + chunk_tokens])
        loss += token_loss.sum() * scale
        dz = torch.softmax(z, dim=-1)  # reuse: z is no longer needed
        del z
        dz.scatter_add_(1, y_safe[:, None], torch.full_like(picked[:, None], -1.0))
        dz *= (valid.float() * scale)[:, None]
        dz = dz.to(hidden.dtype)
        grad_hidden[lo : lo + chunk_tokens] = dz @ weight
        grad_weight.addmm_(dz.T, h)
    return loss, grad_hidden
