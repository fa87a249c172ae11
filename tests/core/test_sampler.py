"""Sampler against direct computations: argmax, softmax distributions, penalty formulas, log_softmax logprobs."""

import math

import pytest
import torch

from pagedllm.sample.greedy import greedy_token_ids
from pagedllm.sched.request import Request
from pagedllm.sample.sampler import Sampler, apply_penalties, top_k_top_p_cutoff
from pagedllm.sampling_params import SamplingParams

VOCAB = 64
EOS = 5


def req(prompt=(1, 2, 3), eos=EOS, **kw):
    return Request("r", list(prompt), SamplingParams(**kw), eos_token_id=eos)


def probs_logits(probs):
    """Logits over VOCAB whose softmax puts `probs` on the first tokens and ~0 elsewhere."""
    x = torch.full((VOCAB,), -1e4)
    x[: len(probs)] = torch.tensor(probs).log()
    return x


def draw(logits_row, n=4000, **kw):
    """n independent draws from one distribution, as one batch of n identical requests."""
    reqs = [req(**kw) for _ in range(n)]
    out = Sampler()(logits_row.expand(n, -1), reqs)
    return torch.bincount(torch.tensor(out.token_ids), minlength=VOCAB)


def test_greedy_is_argmax_any_dtype():
    torch.manual_seed(0)
    logits = torch.randn(7, VOCAB)
    reqs = [req(temperature=0.0) for _ in range(7)]
    for dt in (torch.float32, torch.bfloat16, torch.float16):
        out = Sampler()(logits.to(dt), reqs)
        assert out.token_ids == logits.to(dt).float().argmax(-1).tolist()
        assert out.logprobs == [None] * 7
        assert out.sampled_logprob == [0.0] * 7  # nobody asked for logprobs: the log_softmax is skipped
        lp_reqs = [req(temperature=0.0, logprobs=0) for _ in range(7)]
        out = Sampler()(logits.to(dt), lp_reqs)
        ref = logits.to(dt).float().log_softmax(-1).gather(1, torch.tensor(out.token_ids)[:, None]).squeeze(1)
        assert out.sampled_logprob == pytest.approx(ref.tolist(), abs=1e-5)


@pytest.mark.parametrize("vocab", [509, 512, 32000, 49152])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_blocked_greedy_is_first_argmax(vocab, dtype):
    g = torch.Generator().manual_seed(vocab)
    x = torch.randn(9, vocab, generator=g).to(dtype)
    x[1, :] = 0.5  # all tied: the first index
    x[2, 300] = x[2, vocab - 1] = 99.0  # a tie across blocks: the earlier one
    x[3, 7] = x[3, 8] = 99.0  # a tie inside a block
    x[4, vocab - 1] = 99.0  # the last index
    x[5, 200] = float("nan")  # NaN counts as the maximum, as in argmax
    x[6, :] = float("-inf")
    wide = torch.randn(9, vocab + 64, generator=g).to(dtype)[:, 32:32 + vocab]  # rows with a stride, not contiguous
    for logits in (x, wide, x[:1]):
        assert torch.equal(greedy_token_ids(logits), logits.argmax(-1))
    assert greedy_token_ids(x)[[1, 2, 3, 4, 5, 6]].tolist() == [0, 300, 7, vocab - 1, 200, 0]


def test_greedy_rows_in_mixed_batch():
    torch.manual_seed(1)
    logits = torch.randn(4, VOCAB)
    reqs = [req(temperature=0.0), req(temperature=1.0), req(temperature=1e-6), req(temperature=0.7, top_k=3)]
    out = Sampler()(logits, reqs)
    assert out.token_ids[0] == int(logits[0].argmax())
    assert out.token_ids[2] == int(logits[2].argmax())
    assert out.token_ids[3] in logits[3].topk(3).indices.tolist()


def _seeded_run(seed, position, batch, steps=12):
    """Tokens of one seeded request over `steps` steps, placed at `position` in a batch of other requests."""
    gen = torch.Generator().manual_seed(1234)
    target = req(seed=seed, temperature=1.0)
    others = [req(seed=99, temperature=0.8), req(temperature=1.0), req(temperature=0.0), req(top_p=0.9)][: batch - 1]
    reqs = others[:position] + [target] + others[position:]
    for _ in range(steps):
        logits = torch.randn(len(reqs), VOCAB, generator=gen)
        logits[position] = torch.randn(VOCAB, generator=torch.Generator().manual_seed(len(target.output_token_ids)))
        out = Sampler()(logits, reqs)
        for r, t in zip(reqs, out.token_ids):
            r.append_token(t)
    return target.output_token_ids


def test_seeded_rows_reproducible_across_batches():
    alone = _seeded_run(seed=7, position=0, batch=1)
    assert _seeded_run(seed=7, position=0, batch=1) == alone
    assert _seeded_run(seed=7, position=2, batch=4) == alone
    assert _seeded_run(seed=7, position=4, batch=5) == alone
    assert _seeded_run(seed=8, position=0, batch=1) != alone


def test_unseeded_rows_follow_global_seed():
    logits = torch.randn(16, VOCAB, generator=torch.Generator().manual_seed(0))
    torch.manual_seed(3)
    a = Sampler()(logits, [req() for _ in range(16)]).token_ids
    torch.manual_seed(3)
    b = Sampler()(logits, [req() for _ in range(16)]).token_ids
    assert a == b


def _check_support(counts, allowed, expected=None, n=4000):
    emitted = set(torch.nonzero(counts).flatten().tolist())
    assert emitted == set(allowed), emitted
    if expected is not None:  # empirical frequencies within ~5 sigma of the renormalized distribution
        for tok, p in zip(allowed, expected):
            assert abs(counts[tok].item() / n - p) < 5 * math.sqrt(p * (1 - p) / n) + 1e-9


P = [0.4, 0.25, 0.15, 0.1, 0.06, 0.04]


def test_plain_sampling_matches_softmax():
    torch.manual_seed(0)
    _check_support(draw(probs_logits(P)), range(6), P)


def test_temperature_reshapes_distribution():
    torch.manual_seed(0)
    t = 0.5
    expected = torch.tensor(P).log().div(t).softmax(-1).tolist()
    counts = draw(probs_logits(P), temperature=t)
    assert set(torch.nonzero(counts).flatten().tolist()) <= set(range(6))
    for tok, p in enumerate(expected):
        assert abs(counts[tok].item() / 4000 - p) < 5 * math.sqrt(p * (1 - p) / 4000) + 2e-3


def test_top_k():
    torch.manual_seed(0)
    _check_support(draw(probs_logits(P), top_k=3), [0, 1, 2], [0.5, 0.3125, 0.1875])


def test_top_p():
    torch.manual_seed(0)
    # mass before each token: 0, .4, .65, .8 ... -> top_p=0.6 keeps {0, 1}; 0.7 keeps {0, 1, 2}
    _check_support(draw(probs_logits(P), top_p=0.6), [0, 1], [0.4 / 0.65, 0.25 / 0.65])
    _check_support(draw(probs_logits(P), top_p=0.7), [0, 1, 2], [0.5, 0.3125, 0.1875])


def test_top_k_and_top_p_combined_and_per_row():
    torch.manual_seed(0)
    logits = probs_logits(P).expand(6000, -1)
    reqs = [req(top_k=2, top_p=0.9), req(top_p=0.7), req(top_k=4), req(), req(min_p=0.3), req(temperature=0)] * 1000
    toks = torch.tensor(Sampler()(logits, reqs).token_ids).view(1000, 6)
    assert set(toks[:, 0].tolist()) == {0, 1}
    assert set(toks[:, 1].tolist()) == {0, 1, 2}
    assert set(toks[:, 2].tolist()) == {0, 1, 2, 3}
    assert set(toks[:, 3].tolist()) == set(range(6))
    assert set(toks[:, 4].tolist()) == {0, 1, 2}
    assert set(toks[:, 5].tolist()) == {0}


def _ref_kept(row, k, p):
    """Tokens kept by top-k then top-p, by a plain full sort in float64."""
    srt = sorted(row.tolist(), reverse=True)
    kth = srt[k - 1] if k < len(srt) else -math.inf
    kept = torch.tensor([v for v in srt if v >= kth], dtype=torch.float64)
    probs, acc, n = kept.softmax(0).tolist(), 0.0, 0
    while n < len(probs) and acc < p:
        acc, n = acc + probs[n], n + 1
    cut = max(kth, kept[n - 1].item())
    return set(torch.nonzero(row >= cut).flatten().tolist())


def test_top_k_top_p_cutoff_matches_full_sort():
    torch.manual_seed(0)
    vocab = 1000  # wider than the 256 pre-sorted candidates
    logits = torch.randn(8, vocab) * torch.tensor([4.0, 4.0, 0.1, 0.1, 1.0, 1.0, 2.0, 0.01]).unsqueeze(1)
    top_k = torch.tensor([vocab, 5, vocab, 700, 300, vocab, 1, vocab])
    top_p = torch.tensor([0.9, 0.5, 0.95, 0.99, 1.0, 0.3, 0.7, 0.999])  # rows 2, 7: nucleus > 256 tokens
    cut = top_k_top_p_cutoff(logits, top_k, top_p)
    for i in range(8):
        assert set(torch.nonzero(logits[i] >= cut[i]).flatten().tolist()) == _ref_kept(logits[i], top_k[i], top_p[i])
    assert (logits[2] >= cut[2]).sum() > 700 and (logits[7] >= cut[7]).sum() > 700  # full-sort fallback ran


def test_min_p():
    torch.manual_seed(0)
    # threshold 0.3 * 0.4 = 0.12 -> keeps {0, 1, 2}
    _check_support(draw(probs_logits(P), min_p=0.3), [0, 1, 2], [0.5, 0.3125, 0.1875])


def test_penalties_match_formulas():
    torch.manual_seed(0)
    logits = torch.randn(3, VOCAB) * 3
    r0 = req(prompt=[1, 2, 3, 3], repetition_penalty=1.3)
    r1 = req(prompt=[4, 7], presence_penalty=0.5, frequency_penalty=0.25)
    r2 = req(prompt=[9], repetition_penalty=0.8, presence_penalty=-0.4, frequency_penalty=1.0)
    for r, outs in zip((r0, r1, r2), ([3, 10, 10], [7, 7, 7, 11], [9, 12, 12])):
        for t in outs:
            r.append_token(t)
    got = apply_penalties(logits.clone(), [r0, r1, r2])

    want = logits.clone()
    for row, r in enumerate((r0, r1, r2)):
        p = r.params
        for tok in set(r.prompt_token_ids) | set(r.output_token_ids):
            v = want[row, tok]
            want[row, tok] = v / p.repetition_penalty if v > 0 else v * p.repetition_penalty
        for tok in set(r.output_token_ids):
            c = r.output_token_ids.count(tok)
            want[row, tok] -= p.frequency_penalty * c + p.presence_penalty
    torch.testing.assert_close(got, want)


def test_penalty_changes_greedy_choice_but_not_logprobs():
    logits = torch.zeros(1, VOCAB)
    logits[0, 10], logits[0, 11] = 2.0, 1.9
    r = req(prompt=[10], repetition_penalty=1.2, temperature=0.0, logprobs=1)
    out = Sampler()(logits, [r])
    assert out.token_ids == [11]  # 2.0 / 1.2 < 1.9
    raw = logits.log_softmax(-1)[0]
    assert out.logprobs[0][11].logprob == pytest.approx(raw[11].item())
    assert out.logprobs[0][11].rank == 2 and out.logprobs[0][10].rank == 1


def test_min_tokens_bans_eos_and_stop_tokens():
    logits = torch.zeros(1, VOCAB)
    logits[0, EOS], logits[0, 6], logits[0, 7] = 9.0, 8.0, 7.0
    r = req(temperature=0.0, min_tokens=2, stop_token_ids=[6])
    assert Sampler()(logits, [r]).token_ids == [7]
    r.append_token(7)
    assert Sampler()(logits, [r]).token_ids == [7]
    r.append_token(7)  # min_tokens reached
    assert Sampler()(logits, [r]).token_ids == [EOS]
    torch.manual_seed(0)  # also with random sampling: never EOS / stop token before min_tokens
    rs = [req(min_tokens=1, stop_token_ids=[6]) for _ in range(500)]
    toks = set(Sampler()(logits.expand(500, -1), rs).token_ids)
    assert EOS not in toks and 6 not in toks
    multi = req(temperature=0.0, min_tokens=1)  # models with several EOS ids (e.g. Llama 3): all are banned
    multi.eos_token_ids = {EOS, 7}
    assert Sampler()(logits, [multi]).token_ids == [6]
    ig = req(temperature=0.0, min_tokens=3, ignore_eos=True)
    assert Sampler()(logits, [ig]).token_ids == [EOS]


@pytest.mark.parametrize("n", [0, 1, 5])
def test_logprobs_are_raw_log_softmax_with_ranks(n):
    torch.manual_seed(0)
    logits = torch.randn(4, VOCAB) * 2
    reqs = [req(logprobs=n, temperature=0.7, top_k=10, repetition_penalty=1.5, seed=1),
            req(temperature=0.0),
            req(logprobs=n, temperature=1.3),
            req(logprobs=n + 2, temperature=0.0, presence_penalty=1.0)]
    reqs[0].append_token(int(logits[0].argmax()))
    out = Sampler()(logits.to(torch.bfloat16), reqs)
    raw = logits.to(torch.bfloat16).float().log_softmax(-1)
    assert out.logprobs[1] is None
    for i in (0, 2, 3):
        d, tok, want_n = out.logprobs[i], out.token_ids[i], reqs[i].params.logprobs
        top = raw[i].topk(want_n).indices.tolist() if want_n else []
        assert list(d)[0] == tok
        assert set(d) == set(top) | {tok}
        assert len(d) == want_n + (tok not in top)
        for t, lp in d.items():
            assert lp.logprob == pytest.approx(raw[i, t].item(), abs=1e-5)
            assert lp.rank == int((raw[i] > raw[i, t]).sum()) + 1
        assert out.sampled_logprob[i] == pytest.approx(raw[i, tok].item(), abs=1e-5)


def test_caller_logits_untouched():
    torch.manual_seed(0)
    logits = torch.randn(3, VOCAB)
    before = logits.clone()
    reqs = [req(top_p=0.5, presence_penalty=1.0), req(top_k=2, min_p=0.1), req(temperature=0.0, min_tokens=1)]
    reqs[0].append_token(1)
    Sampler()(logits, reqs)
    assert torch.equal(logits, before)
