"""The chunked linear + cross-entropy equals the plain loss and its autograd gradients."""

import pytest
import torch
import torch.nn.functional as F

from slidedp.exec.loss import IGNORE_INDEX, cross_entropy_sum, linear_cross_entropy, shift_labels


@pytest.mark.parametrize("chunk_tokens", [1, 7, 64])
def test_chunked_loss_matches_plain(chunk_tokens):
    gen = torch.Generator().manual_seed(0)
    T, h, V = 40, 16, 50
    hidden = torch.randn(T, h, generator=gen, dtype=torch.float64)
    weight = torch.randn(V, h, generator=gen, dtype=torch.float64)
    targets = torch.randint(0, V, (T,), generator=gen)
    targets[::5] = IGNORE_INDEX
    n_global = 100  # the global batch has more tokens than this micro-batch
    hr, wr = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    ref = F.cross_entropy(hr @ wr.T, targets, ignore_index=IGNORE_INDEX, reduction="sum") / n_global
    ref.backward()
    gw = torch.full_like(weight, 0.5)  # accumulates into what is there
    loss, gh = linear_cross_entropy(hidden, weight, targets, 1.0 / n_global, gw, chunk_tokens)
    torch.testing.assert_close(loss.double(), ref.detach(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(gh, hr.grad)
    torch.testing.assert_close(gw, wr.grad + 0.5)


def test_shift_labels_like_hf():
    labels = torch.tensor([[1, 2, 3], [4, IGNORE_INDEX, 6]])
    assert shift_labels(labels).tolist() == [[2, 3, IGNORE_INDEX], [IGNORE_INDEX, 6, IGNORE_INDEX]]


def test_forward_only_sum_matches_plain():
    gen = torch.Generator().manual_seed(1)
    hidden, weight = torch.randn(30, 8, generator=gen), torch.randn(20, 8, generator=gen)
    targets = torch.randint(0, 20, (30,), generator=gen)
    targets[::4] = IGNORE_INDEX
    ref = F.cross_entropy(hidden @ weight.T, targets, ignore_index=IGNORE_INDEX, reduction="sum")
    for chunk in (1, 7, 64):
        torch.testing.assert_close(cross_entropy_sum(hidden, weight, targets, chunk), ref)
