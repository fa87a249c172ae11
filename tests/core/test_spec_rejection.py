"""Rejection sampler (spec_decode/rejection_sampler.py): greedy rule, exactness of random verification, seeds."""

from __future__ import annotations

import pytest
import torch

from pagedllm.spec_decode.rejection_sampler import greedy_verify, rejection_sample


def test_greedy_accepts_while_draft_equals_argmax():
    assert greedy_verify([5, 6, 7], [5, 6, 7, 8]) == [5, 6, 7, 8]  # all accepted + bonus
    assert greedy_verify([5, 6, 7], [5, 9, 7, 8]) == [5, 9]  # target's token at the first mismatch
    assert greedy_verify([5], [4, 1]) == [4]
    assert greedy_verify([], [3]) == [3]


def _estimate(target: torch.Tensor, draft: torch.Tensor, k: int, num_samples: int, one_hot: bool,
              gen: torch.Generator) -> torch.Tensor:
    """Empirical distribution of the FIRST emitted token (vLLM's test: proposals drawn from q, verified against p)."""
    vocab = target.shape[-1]
    if one_hot:
        drafts = torch.multinomial(draft, num_samples * k, replacement=True, generator=gen).view(num_samples, k)
        q = None
    else:
        drafts = torch.multinomial(draft, num_samples * k, replacement=True, generator=gen).view(num_samples, k)
        q = draft.expand(num_samples, k, vocab)
    p = target.expand(num_samples, k + 1, vocab)
    torch.manual_seed(int(torch.randint(0, 2**31, (1,), generator=gen)))
    out = rejection_sample(drafts, [k] * num_samples, p, q)
    first = torch.tensor([o[0] for o in out])
    return torch.bincount(first, minlength=vocab).double() / num_samples


@pytest.mark.parametrize("one_hot", [False, True])
def test_rejection_sampling_approximates_target_distribution(one_hot):
    """As vLLM's test of the same name: with random p and q, the distance of the emitted tokens' distribution to the
    target shrinks with the number of samples, far faster than the distance to a perturbed reference does."""
    gen = torch.Generator().manual_seed(0)
    vocab, k = 10, 2
    for trial in range(3):
        target = torch.softmax(3 * torch.randn(vocab, generator=gen), 0).double()
        draft = torch.softmax(3 * torch.randn(vocab, generator=gen), 0).double()
        # q one-hot: the proposer's "distribution" is a point mass on its proposal, so drafts come from q regardless
        reference = torch.softmax(torch.log(target) + 0.5 * torch.randn(vocab, generator=gen, dtype=torch.float64), 0)
        dist_t, dist_r = [], []
        for n in (1000, 10000, 100000):
            est = _estimate(target, draft, k, n, one_hot, gen)
            dist_t.append((est - target).abs().sum().item())
            dist_r.append((est - reference).abs().sum().item())
        # Distance to the target falls roughly like 1/sqrt(n) (two decades: >= ~5x); to the reference it plateaus.
        assert dist_t[-1] < dist_t[0] / 4, (trial, dist_t)
        assert dist_t[-1] < 0.02, dist_t
        assert dist_r[-1] > 5 * dist_t[-1], (dist_t, dist_r)
        assert dist_r[0] / dist_r[-1] < dist_t[0] / dist_t[-1]


def test_all_positions_follow_target_when_drafts_match_target():
    """q == p: every draft is accepted (min(1, p/q) = 1) and each emitted position is distributed as p."""
    gen = torch.Generator().manual_seed(1)
    vocab, k, n = 6, 3, 20000
    p = torch.softmax(torch.randn(vocab, generator=gen), 0).double()
    drafts = torch.multinomial(p, n * k, replacement=True, generator=gen).view(n, k)
    out = rejection_sample(drafts, [k] * n, p.expand(n, k + 1, vocab), p.expand(n, k, vocab))
    assert all(len(o) == k + 1 for o in out)
    bonus = torch.bincount(torch.tensor([o[-1] for o in out]), minlength=vocab).double() / n
    assert (bonus - p).abs().sum() < 0.03


def test_padded_rows_and_zero_drafts():
    """Rows with fewer drafts than the batch width ignore the padding; a row with no draft just samples p_0."""
    p = torch.zeros(2, 3, 4, dtype=torch.float64)
    p[:, :, 3] = 1.0  # the target always says token 3
    drafts = torch.tensor([[3, 3], [1, 0]])
    out = rejection_sample(drafts, [2, 0], p)
    assert out == [[3, 3, 3], [3]]
    drafts = torch.tensor([[3, 1], [1, 0]])
    assert rejection_sample(drafts, [2, 1], p) == [[3, 3], [3]]


def test_seeded_rows_reproducible_whatever_the_batch():
    gen = torch.Generator().manual_seed(2)
    vocab, k = 8, 3
    p = torch.softmax(torch.randn(4, k + 1, vocab, generator=gen), -1)
    q = torch.softmax(torch.randn(4, k, vocab, generator=gen), -1)
    d = torch.randint(0, vocab, (4, k), generator=gen)
    runs = []
    for batch in (4, 1):
        gens = [torch.Generator().manual_seed(123)] + [None] * (batch - 1)
        runs.append(rejection_sample(d[:batch], [k] * batch, p[:batch], q[:batch], gens)[0])
    assert runs[0] == runs[1]
