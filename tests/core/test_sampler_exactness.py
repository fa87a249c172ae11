"""The two-level inverse-CDF draw and the fast logprob ranks against direct computations: a chi-square test of the
draws against the softmax distribution, the flat float64 CDF for the same uniforms, and brute-force ranks."""

import torch
from scipy.stats import chisquare

from pagedllm.sample.sampler import inverse_cdf_sample, logprob_entries
from pagedllm.sched.request import Request
from pagedllm.sample.sampler import Sampler
from pagedllm.sampling_params import SamplingParams


def flat_cdf_sample(probs, u):
    """The reference: one float64 CDF over the whole vocabulary."""
    cdf = probs.double().cumsum(dim=-1)
    return torch.searchsorted(cdf, ((1.0 - u) * cdf[:, -1]).unsqueeze(1)).squeeze(1)


def test_draws_follow_the_softmax_distribution():
    # 37 tokens in blocks of 8 (the last block padded), zero-probability tokens and a light tail
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(37, generator=g) * 1.5
    logits[[3, 8, 9, 36]] = float("-inf")
    probs = logits.softmax(dim=-1)
    n = 200_000
    u = torch.rand(n, dtype=torch.float64, generator=g)
    tokens = inverse_cdf_sample(probs.expand(n, -1), u, block=8)
    counts = torch.bincount(tokens, minlength=37)
    assert counts[[3, 8, 9, 36]].sum() == 0  # never a zero-probability token
    keep = probs > 0
    p = probs[keep].double()
    expected = p / p.sum() * n
    assert chisquare(counts[keep].double().numpy(), expected.numpy()).pvalue > 1e-4


def test_same_tokens_as_a_flat_float64_cdf_for_the_same_uniforms():
    g = torch.Generator().manual_seed(1)
    probs = (torch.randn(64, 49152, generator=g) * 4).softmax(dim=-1)
    probs[:, 100:5000] = 0.0  # unnormalized rows are fine too
    u = torch.rand(64, dtype=torch.float64, generator=g)
    u[0], u[1] = 0.0, 1.0 - 2 ** -53  # the ends: the last / first token with mass
    assert inverse_cdf_sample(probs, u).tolist() == flat_cdf_sample(probs, u).tolist()


def test_seeded_rows_keep_their_tokens_whatever_the_batch():
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(1, 3000, generator=g)

    def seeded(seed):
        return Request(f"r{seed}", [1, 2], SamplingParams(temperature=1.0, seed=seed, max_tokens=8))

    alone = [Sampler()(logits, [seeded(s)]).token_ids[0] for s in range(6)]
    batch = [seeded(s) for s in range(6)] + [Request("x", [1], SamplingParams(temperature=0.7))]
    together = Sampler()(logits.expand(7, -1), batch).token_ids[:6]
    assert alone == together


def test_ranks_match_brute_force_inside_and_outside_the_top_n():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(12, 500, generator=g)
    logits[5, :250] = float("-inf")
    lps = logits.log_softmax(dim=-1)
    order = lps.argsort(dim=-1, descending=True)
    # rows 0-3 pick a top-3 token, the rest a token far down (row 5: one at -inf)
    picks = [order[r, r % 3] if r < 4 else order[r, 100 + r] for r in range(12)]
    picks[5] = torch.tensor(10)
    tokens = torch.stack(picks)
    for nums in ([3] * 12, [0] * 12, [5, 0, 1, 2] * 3):
        entries = logprob_entries(lps, tokens, nums)
        for r, d in enumerate(entries):
            tok = int(tokens[r])
            assert d[tok].rank == int((lps[r] > lps[r, tok]).sum()) + 1
            assert d[tok].logprob == float(lps[r, tok])
            top = lps[r].topk(nums[r])
            for k, (v, i) in enumerate(zip(top.values.tolist(), top.indices.tolist())):
                if i != tok:
                    assert (d[i].logprob, d[i].rank) == (v, k + 1)
            assert len(d) == len(set(top.indices.tolist()) | {tok})
