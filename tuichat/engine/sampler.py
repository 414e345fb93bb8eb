"""Next-token choice on the device: greedy rows in one argmax, the others with their own randomness, keyed by
position, so a seed gives the same text whatever else shares the batch and however many tokens a step
verifies."""

from __future__ import annotations

import hashlib
import secrets

import torch

from tuichat.engine.types import SamplingParams


class Noise:
    """A request's randomness: the draw for the token at position p depends only on the seed and p. So a
    speculative step, which samples several positions at once and may keep only some, draws for each what a
    one-token step would have, and a reply is the same with speculation on or off."""

    def __init__(self, seed: int | None, device: torch.device) -> None:
        self.seed = secrets.randbits(64) if seed is None else seed
        self.generator = torch.Generator(device=device)

    def at(self, position: int) -> torch.Generator:
        key = hashlib.blake2b(f"{self.seed}:{position}".encode(), digest_size=8).digest()
        return self.generator.manual_seed(int.from_bytes(key, "little"))


def make_generator(params: SamplingParams, device: torch.device) -> Noise | None:
    return None if params.temperature <= 0 else Noise(params.seed, device)


def _filter(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    logits = logits / params.temperature
    if 0 < params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        drop = cumulative - sorted_logits.softmax(-1) >= params.top_p  # keep the token that crosses top_p
        logits = logits.masked_fill(drop.scatter(0, order, drop), float("-inf"))
    return logits


def penalize(logits: torch.Tensor, params: SamplingParams, reply: list[int]) -> torch.Tensor:
    """One row's logits less its penalties for the tokens of its reply so far (OpenAI's definition)."""
    if not reply or not (params.presence_penalty or params.frequency_penalty):
        return logits
    counts = torch.bincount(torch.tensor(reply, device=logits.device), minlength=logits.shape[-1])[: logits.shape[-1]]
    return logits - params.frequency_penalty * counts - params.presence_penalty * (counts > 0)


def sample(logits: torch.Tensor, params: list[SamplingParams], noises: list[Noise | None], positions: list[int],
           replies: list[list[int]] | None = None) -> list[int]:
    """logits: [N, vocab] float32; positions: where each row's token goes in its sequence; replies: each row's
    generated ids before it (for the penalties). Returns one token id per row."""
    if replies is not None:  # the engine passes them only when a row has a penalty
        logits = torch.stack([penalize(row, p, reply) for row, p, reply in zip(logits, params, replies)])
    chosen = logits.argmax(dim=-1)
    for row, (p, noise_source) in enumerate(zip(params, noises)):
        if p.temperature > 0:
            probs = _filter(logits[row], p).softmax(-1)
            # Exponential race: argmax(p / E) with E ~ Exp(1) is a draw from p, and takes a generator.
            noise = torch.empty_like(probs).exponential_(generator=noise_source.at(positions[row]))
            chosen[row] = (probs / noise).argmax()
    return chosen.tolist()
