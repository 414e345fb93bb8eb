"""The sampler against transformers' own logits warpers: the tokens it can choose are the ones temperature,
top_k and top_p keep there, and how often it chooses each is their probability."""

import numpy as np
import pytest
import torch
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from tuichat.engine.sampler import Noise, sample
from tuichat.engine.types import SamplingParams


def reference_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """What transformers' generate samples from with these settings (warpers in its order)."""
    scores = TemperatureLogitsWarper(params.temperature)(None, logits[None].clone())
    if params.top_k:
        scores = TopKLogitsWarper(params.top_k)(None, scores)
    if params.top_p < 1.0:
        scores = TopPLogitsWarper(params.top_p)(None, scores)
    return scores[0].softmax(-1)


SETTINGS = [
    SamplingParams(temperature=0.7),
    SamplingParams(temperature=1.0, top_k=5),
    SamplingParams(temperature=0.8, top_p=0.9),
    SamplingParams(temperature=1.3, top_k=12, top_p=0.8),
    SamplingParams(temperature=0.2, top_p=0.9),
]


@pytest.mark.parametrize("params", SETTINGS, ids=lambda p: f"T{p.temperature}-k{p.top_k}-p{p.top_p}")
def test_draws_follow_the_distribution_transformers_samples_from(params, draw_kernels):
    logits = torch.randn(40, generator=torch.Generator().manual_seed(3)) * 2
    want = reference_probs(logits, params)
    noise = Noise(seed=7)
    draws = 4000
    counts = np.zeros(logits.shape[0])
    for position in range(draws):
        counts[sample(logits[None], [params], [noise], [position], kernels=draw_kernels)[0]] += 1
    assert set(np.flatnonzero(counts)) <= set(torch.nonzero(want).flatten().tolist())  # never a filtered token
    total_variation = 0.5 * np.abs(counts / draws - want.numpy()).sum()
    assert total_variation < 0.05


@pytest.mark.parametrize("temperature", [0.05, 0.2, 0.7, 1.5, 4.0])
def test_on_a_real_vocabulary_the_kept_tokens_are_exactly_top_ps(temperature, draw_kernels):
    """A vocabulary of SmolLM2's size, from a nucleus of a few tokens (the floors' fast path) to one of
    thousands (the full sort): the candidates the sampler can draw are transformers' set, no more, no less."""
    params = SamplingParams(temperature=temperature, top_p=0.9)
    generator = torch.Generator().manual_seed(int(temperature * 100))
    for _ in range(4):
        logits = torch.randn(49152, generator=generator) * 3
        want = set(torch.nonzero(reference_probs(logits, params)).flatten().tolist())
        # Draws at the two ends of [0, 1) reach the likeliest and the least likely kept token.
        ends = [Noise(0), Noise(0)]
        ends[0].uniform = lambda position: 0.0
        ends[1].uniform = lambda position: 1.0 - 2.0**-53
        low, high = sample(logits[None].repeat(2, 1), [params] * 2, ends, [0, 0], kernels=draw_kernels)
        kept = torch.tensor(sorted(want))
        probs = reference_probs(logits, params)[kept]
        assert low == int(kept[probs.argmax()])
        assert high in want
        # The least likely kept token is the last in a descending order: it is what u -> 1 picks.
        assert probs[kept.tolist().index(high)] == probs.min()


def test_a_nucleus_of_thousands_with_ties_is_ordered_likeliest_first_then_by_id(draw_kernels):
    """A flat row (logits on three levels, 30,000 tokens, so that the nucleus is nearly all of them and the kernels
    sort it by radix): a draw at the middle of the k-th token's share of the mass, in the order likeliest first
    and ties by id, picks that token. The order and the shares are computed here, in float64."""
    rng = np.random.default_rng(5)
    levels = rng.integers(0, 3, 30000)
    logits = torch.from_numpy(-levels.astype(np.float32))
    params = SamplingParams(temperature=1.0, top_p=0.95)  # its cut among the level-2 tokens
    order = np.lexsort((np.arange(len(levels)), levels))  # by level (likeliest first), then by id
    weights = np.exp(-levels[order].astype(np.float64))
    ends = np.cumsum(weights)
    kept = np.count_nonzero(np.concatenate([[0.0], ends[:-1]]) < params.top_p * ends[-1])  # top_p's cut
    for k in [0, 1, 2, 4999, 9000, 12000, 16000, 19000]:  # levels 0 and 1: shares wider than the sums' rounding
        noise = Noise(0)
        noise.uniform = lambda position, k=k: (ends[k] - weights[k] / 2) / ends[kept - 1]
        assert sample(logits[None], [params], [noise], [0], kernels=draw_kernels)[0] == order[k], k


def test_a_seed_and_a_position_always_give_the_same_token_and_another_seed_differs():
    logits = torch.randn(3, 500, generator=torch.Generator().manual_seed(1))
    params = [SamplingParams(temperature=1.0, top_p=0.95)] * 3
    first = sample(logits, params, [Noise(5)] * 3, [10, 11, 12])
    again = sample(logits, params, [Noise(5)] * 3, [10, 11, 12])
    others = [sample(logits, params, [Noise(seed)] * 3, [10, 11, 12]) for seed in range(6, 12)]
    assert first == again
    assert any(o != first for o in others)


def test_penalized_draws_follow_openais_penalties_then_transformers_warpers(draw_kernels):
    """frequency_penalty times a token's count in the reply so far plus presence_penalty once, off its logit
    (OpenAI's definition, counted here independently), then temperature and top_p."""
    from collections import Counter

    logits = torch.randn(40, generator=torch.Generator().manual_seed(4)) * 2
    reply = [int(logits.argmax())] * 3 + [5, 5, 17, 39]
    params = SamplingParams(temperature=0.8, top_p=0.95, frequency_penalty=0.6, presence_penalty=0.3)
    penalized = logits.clone()
    for token, count in Counter(reply).items():
        penalized[token] -= params.frequency_penalty * count + params.presence_penalty
    want = reference_probs(penalized, params)
    noise, draws = Noise(seed=9), 4000
    counts = np.zeros(logits.shape[0])
    for position in range(draws):
        counts[sample(logits[None], [params], [noise], [position], [reply], kernels=draw_kernels)[0]] += 1
    assert set(np.flatnonzero(counts)) <= set(torch.nonzero(want).flatten().tolist())
    assert 0.5 * np.abs(counts / draws - want.numpy()).sum() < 0.05
