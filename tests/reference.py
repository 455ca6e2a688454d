"""The plain-PyTorch reference the executor is checked against: the same transformers model,
torch.optim.AdamW (with torch.nn.utils.clip_grad_norm_ when the optimizer clips), same batches.

Shared by the single-rank and the multi-rank equivalence tests.
"""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from slidedp.exec.adamw import AdamWConfig
from slidedp.exec.layout import model_layout


def plain_adamw(cfg: dict, batches, opt_cfg: AdamWConfig, seed: int, device: str = "cpu"):
    """(losses, unclipped gradient norms, initial units, final units) of plain training, its
    forward, backward and AdamW on `device` (the units come back on the CPU): a run of the
    executor on a GPU is compared with a reference whose gradients come from the same kernels."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg))
    layouts = model_layout(model)
    model.to(device)

    def flat():
        sd = model.state_dict()
        return [torch.cat([sd[e.name].reshape(-1) for e in lay.entries]).cpu() for lay in layouts]

    init = flat()
    opt = torch.optim.AdamW(model.parameters(), lr=opt_cfg.lr, betas=opt_cfg.betas,
                            eps=opt_cfg.eps, weight_decay=opt_cfg.weight_decay)
    losses, norms = [], []
    for ids, labels in batches:
        loss = model(ids.to(device), labels=labels.to(device)).loss
        loss.backward()
        norms.append(float(torch.sqrt(sum((p.grad.double() ** 2).sum() for p in model.parameters()))))
        if opt_cfg.grad_clip is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), opt_cfg.grad_clip)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, norms, init, flat()
