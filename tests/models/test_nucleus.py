"""The hf backend's top-p filter keeps the tokens transformers' TopPLogitsWarper keeps, without its full sort.

transformers adds up float32 probabilities from the least likely token up, rsiflow float64 ones from the most likely
down, so on a nucleus of thousands of near-equal tokens a token of ~1e-5 probability lying exactly at the boundary
can fall on either side; the tests bound what may differ to such tokens. (On the logits SmolLM2 sampled household
actions from, the kept sets were identical in every row at top_p 0.5-0.99: `python -m bench.decode`.)"""

import pytest
import torch
from transformers.generation.logits_process import TopPLogitsWarper

from rsiflow.models.hf_backend import NucleusWarper, sample_nucleus

VOCAB = 49_152  # SmolLM2's


def _logits(rows: int, spread: float, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, VOCAB, generator=g) * spread


def _assert_same_up_to_the_boundary(scores, got, expected):
    differ = torch.isinf(got) != torch.isinf(expected)
    probs = scores.softmax(dim=-1)
    assert differ.sum(-1).max() <= 10, differ.sum(-1)
    assert (probs * differ).sum(-1).max() < 1e-4  # what differs is a sliver of probability at the boundary
    small = (~torch.isinf(expected)).sum(-1) < 1000  # a nucleus of up to hundreds of tokens: no slack at all
    assert not differ[small].any()


@pytest.mark.parametrize("top_p", [0.0, 0.5, 0.9, 0.95, 0.999])
@pytest.mark.parametrize("spread", [0.5, 3.0, 12.0])  # a flat row (nucleus of thousands), a mixed one, a peaked one
def test_keeps_the_same_tokens_as_transformers(top_p, spread):
    scores = _logits(8, spread, seed=int(spread * 10) + int(top_p * 1000))
    expected = TopPLogitsWarper(top_p)(None, scores.clone())
    got = NucleusWarper(top_p)(None, scores.clone())
    _assert_same_up_to_the_boundary(scores, got, expected)
    kept = ~torch.isinf(got)
    assert torch.equal(got[kept], scores[kept])  # kept scores are untouched
    assert kept.sum(-1).min() >= 1


def test_rows_needing_more_than_the_first_ranks_are_widened():
    # One flat row needs thousands of tokens, one peaked row one: both must come out right in one call.
    scores = torch.cat([_logits(1, 0.1, seed=1), _logits(1, 20.0, seed=2)])
    got = NucleusWarper(0.95, first_k=4)(None, scores.clone())
    expected = TopPLogitsWarper(0.95)(None, scores.clone())
    _assert_same_up_to_the_boundary(scores, got, expected)
    assert (~torch.isinf(got[0])).sum() > 1000 and (~torch.isinf(got[1])).sum() < 1000


def _whole_batch_widening(scores: torch.Tensor, top_p: float, first_k: int) -> torch.Tensor:
    """The filter as it was: every row ranked k wide until all rows' nuclei fit."""
    probs = scores.double().softmax(dim=-1)
    k = first_k
    while True:
        top, index = probs.topk(k, dim=-1)
        mass = top.cumsum(dim=-1)
        if k == probs.shape[-1] or bool((mass[:, -1] >= top_p).all()):
            break
        k = min(8 * k, probs.shape[-1])
    keep_ranked = mass - top < top_p
    keep_ranked[:, 0] = True
    keep = torch.zeros_like(probs, dtype=torch.bool).scatter_(1, index, keep_ranked)
    return scores.masked_fill(~keep, -float("inf"))


@pytest.mark.parametrize("first_k", [4, 128])
def test_widening_only_the_wide_rows_keeps_exactly_what_widening_all_rows_kept(first_k):
    # peaked, mixed and flat rows in one batch: the narrow ones are padded while the wide ones are ranked again
    scores = torch.cat([_logits(3, 20.0, seed=3), _logits(3, 2.0, seed=4), _logits(2, 0.1, seed=5)])
    scores[:, :2] += torch.tensor([[9.0], [4.0], [0.0], [6.0], [3.0], [0.0], [0.0], [0.0]])
    for top_p in (0.5, 0.9, 0.95):
        expected = _whole_batch_widening(scores, top_p, first_k)
        assert torch.equal(NucleusWarper(top_p, first_k=first_k)(None, scores.clone()), expected)


def test_the_most_likely_token_is_always_kept():
    scores = torch.tensor([[5.0, 1.0, 0.0, -1.0]])
    got = NucleusWarper(0.0)(None, scores)
    assert torch.isfinite(got[0, 0]) and torch.isinf(got[0, 1:]).all()


def test_rejects_a_top_p_outside_0_1():
    with pytest.raises(ValueError, match="top_p"):
        NucleusWarper(1.5)


@pytest.mark.parametrize("spread", [1.0, 4.0])   # a nucleus of hundreds of tokens; a peaked one of a few
def test_drawing_among_the_nucleus_follows_the_nucleus_distribution(spread):
    """sample_nucleus draws token i with probability p_i / (nucleus mass), as multinomial over the masked
    distribution does, and returns exactly that distribution's logprob and the temperature-only one."""
    torch.manual_seed(0)
    logits = _logits(1, spread, seed=7)[:, :2048]   # a smaller vocabulary: 20,000 draws stay cheap
    temperature, top_p, n = 0.8, 0.9, 20_000
    warped = NucleusWarper(top_p)(None, logits.double() / temperature)
    nucleus = warped.softmax(-1)[0]
    draws = [sample_nucleus(logits.expand(2000, -1), temperature, top_p) for _ in range(n // 2000)]
    tokens, logprobs, temp_logprobs = (torch.cat(x) for x in zip(*draws))
    assert bool(torch.isfinite(warped[0, tokens]).all())   # every draw is in the nucleus
    counts = torch.bincount(tokens, minlength=logits.shape[1]).double() / n
    # total variation from the nucleus: an exact sampler's expected value is ~ sum_i sqrt(p_i / (2 pi n))
    expected_tv = (nucleus / (2 * torch.pi * n)).sqrt().sum().item()
    assert (counts - nucleus).abs().sum().item() / 2 < 1.3 * expected_tv + 0.005
    top = nucleus.argmax()
    assert abs(counts[top] - nucleus[top]) < 4 * (nucleus[top] * (1 - nucleus[top]) / n) ** 0.5 + 1e-9
    assert torch.allclose(logprobs.double(), warped.log_softmax(-1)[0, tokens], atol=1e-6)
    assert torch.allclose(temp_logprobs.double(), (logits.double() / temperature).log_softmax(-1)[0, tokens],
                          atol=1e-6)


def test_drawing_among_the_nucleus_takes_random_numbers_in_the_draw_order():
    """Rows given in another order draw the same tokens when draw_order names the order to draw them in."""
    logits = torch.cat([_logits(2, 1.0, seed=8), _logits(2, 6.0, seed=9)])
    torch.manual_seed(1)
    expected, _, _ = sample_nucleus(logits, 1.0, 0.95)
    perm = [2, 0, 3, 1]   # batch position b holds row perm[b]
    draw_order = sorted(range(4), key=perm.__getitem__)
    torch.manual_seed(1)
    got, _, _ = sample_nucleus(logits[perm], 1.0, 0.95, draw_order)
    assert got.tolist() == expected[perm].tolist()


def test_drawing_among_the_nucleus_at_top_p_zero_is_greedy():
    logits = _logits(3, 2.0, seed=10)
    assert sample_nucleus(logits, 1.0, 0.0)[0].tolist() == logits.argmax(-1).tolist()
