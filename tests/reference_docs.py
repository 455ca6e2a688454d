"""The plain Hugging Face reference for packed and masked data: every document on its own.

A step is a list of documents, each (input_ids, labels) 1-D; the loss is what HF's
ForCausalLMLoss gives with num_items_in_batch = the label tokens of the whole step (as HF Trainer
computes it for a global batch): sum over documents of the cross-entropy sum over their shifted
labels, divided by that count. Then torch.optim.AdamW, as tests/reference.py.
"""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from slidedp.exec.adamw import AdamWConfig
from slidedp.exec.layout import model_layout


def label_tokens(docs) -> int:
    """Label tokens of a step's documents (shifted: a document's first label predicts nothing)."""
    return sum(int((labels[1:] != -100).sum()) for _, labels in docs)


def doc_losses(model, steps, opt: torch.optim.Optimizer | None = None) -> list[float]:
    """The loss of each step, every document through `model` alone; one AdamW step per step when
    `opt` is given."""
    out = []
    for docs in steps:
        n = label_tokens(docs)
        total = 0.0
        for ids, labels in docs:
            loss = model(ids[None], labels=labels[None], num_items_in_batch=n).loss
            if opt is not None:
                loss.backward()
            total += loss.item()
        if opt is not None:
            opt.step()
            opt.zero_grad()
        out.append(total)
    return out


def plain_adamw_docs(cfg: dict, steps, opt_cfg: AdamWConfig, seed: int):
    """(losses, final units) of plain training on the documents of each step, one by one."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**cfg))
    opt = torch.optim.AdamW(model.parameters(), lr=opt_cfg.lr, betas=opt_cfg.betas,
                            eps=opt_cfg.eps, weight_decay=opt_cfg.weight_decay)
    losses = doc_losses(model, steps, opt)
    sd = model.state_dict()
    units = [torch.cat([sd[e.name].reshape(-1) for e in lay.entries]) for lay in model_layout(model)]
    return losses, units
