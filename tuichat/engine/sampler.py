"""Next-token choice: greedy rows in one argmax, the others by their own draw, keyed by position, so a seed gives
the same text whatever else shares the batch and however many tokens a step verifies.

A sampled row is chosen on the host, in numpy, over one vocabulary row at a time. Why not torch: the obvious
top-p (sort the vocabulary, cumsum, scatter) and a noise draw over it cost more than the model's whole decode
step on a CPU, and torch's per-op overhead on a 49k-entry row outweighs the arithmetic (docs/design/sampling.md
has the figures). Here a row takes a few passes: the nucleus is found among the tokens above a probability
threshold (lowered until they hold top_p of the mass, so the set is exactly the one a full sort gives) and one
uniform number, hashed from the seed and the position, picks from its cumulative mass.
"""

from __future__ import annotations

import hashlib
import secrets

import numpy as np
import torch

from tuichat.engine.types import SamplingParams

# Relative probabilities (to the likeliest token) tried as the nucleus' candidate floor before a full sort.
_FLOORS = (1e-3, 1e-6, 1e-9)
_BLOCK = 1024  # tokens per block of the two-level search over a whole vocabulary


class Noise:
    """A request's randomness: the draw for the token at position p depends only on the seed and p. So a
    speculative step, which samples several positions at once and may keep only some, draws for each what a
    one-token step would have, and a reply is the same with speculation on or off."""

    def __init__(self, seed: int | None) -> None:
        self.seed = secrets.randbits(64) if seed is None else seed

    def uniform(self, position: int) -> float:
        """A number in [0, 1) from the seed and the position alone (53 bits of a blake2b digest)."""
        key = hashlib.blake2b(f"{self.seed}:{position}".encode(), digest_size=8).digest()
        return (int.from_bytes(key, "little") >> 11) * 2.0**-53


def make_generator(params: SamplingParams) -> Noise | None:
    return None if params.temperature <= 0 else Noise(params.seed)


def _has_penalty(params: SamplingParams, reply: list[int] | None) -> bool:
    return bool(reply) and bool(params.presence_penalty or params.frequency_penalty)


def penalize(row: np.ndarray, params: SamplingParams, reply: list[int]) -> np.ndarray:
    """A row's logits less its penalties for the tokens of its reply so far (OpenAI's definition): only the
    tokens the reply holds change, so the cost is the reply's length, not the vocabulary's."""
    tokens, counts = np.unique(np.asarray(reply, dtype=np.int64), return_counts=True)
    inside = tokens < row.shape[0]
    tokens, counts = tokens[inside], counts[inside]
    row = row.copy()
    row[tokens] -= (params.frequency_penalty * counts + params.presence_penalty).astype(row.dtype)
    return row


def _descending(weights: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """ids ordered by weight, largest first; ties by id (a stable sort of ids in ascending order)."""
    return ids[np.argsort(-weights[ids], kind="stable")]


def _nucleus(weights: np.ndarray, params: SamplingParams) -> np.ndarray | None:
    """The tokens top_k and top_p keep, likeliest first, from `weights` (probabilities up to a factor, the
    likeliest 1); None when neither filter is set (every token stays). Candidates are the tokens at or above a
    floor, which come first in any descending order: once they are top_k many, or hold top_p of the mass, the
    filters' answer is among them and only they are sorted."""
    size = weights.shape[0]
    top_k = params.top_k if 0 < params.top_k < size else 0
    if not top_k and params.top_p >= 1.0:
        return None
    total = float(weights.sum())
    for floor in _FLOORS:
        ids = np.flatnonzero(weights >= floor)
        if len(ids) >= top_k and (top_k or float(weights[ids].sum()) >= params.top_p * total):
            break
    else:
        ids = np.arange(size)
    kept = _descending(weights, ids)
    if top_k:
        kept = kept[:top_k]
        total = float(weights[kept].sum())  # top_p then applies to what top_k kept, renormalized
    if params.top_p < 1.0:
        # Keep each token while the mass before it is under top_p: the one that crosses it stays.
        before = np.cumsum(weights[kept], dtype=np.float64) - weights[kept]
        kept = kept[: max(1, int(np.count_nonzero(before < params.top_p * total)))]
    return kept


def _pick(weights: np.ndarray, u: float) -> int:
    """The index whose share of the cumulative mass holds u: in two levels, blocks then tokens, so a whole
    vocabulary costs a sum per block and one block's cumsum."""
    if weights.shape[0] <= _BLOCK:
        cumulative = np.cumsum(weights, dtype=np.float64)
        return min(int(np.searchsorted(cumulative, u * cumulative[-1], side="right")), weights.shape[0] - 1)
    blocks = np.cumsum(np.add.reduceat(weights, np.arange(0, weights.shape[0], _BLOCK), dtype=np.float64))
    target = u * blocks[-1]
    block = min(int(np.searchsorted(blocks, target, side="right")), blocks.shape[0] - 1)
    start = block * _BLOCK
    inner = np.cumsum(weights[start : start + _BLOCK], dtype=np.float64)
    left = target - (blocks[block - 1] if block else 0.0)
    return start + min(int(np.searchsorted(inner, left, side="right")), inner.shape[0] - 1)


def _draw(row: np.ndarray, params: SamplingParams, u: float) -> int:
    weights = np.subtract(row, row.max(), dtype=np.float32)  # a fresh array: the logits stay as they are
    weights *= np.float32(1.0 / params.temperature)
    np.exp(weights, out=weights)
    kept = _nucleus(weights, params)
    if kept is None:
        return _pick(weights, u)
    return int(kept[_pick(weights[kept], u)])


def sample(logits: torch.Tensor, params: list[SamplingParams], noises: list[Noise | None], positions: list[int],
           replies: list[list[int]] | None = None, kernels=None) -> list[int]:
    """logits: [N, vocab] float32; positions: where each row's token goes in its sequence; replies: each row's
    generated ids before it (for the penalties). `kernels` (cpu.native.CpuKernels): draw a row on the CPU with
    their sample_row (sampler.c), the same draw in fewer passes. Returns one token id per row."""
    replies = replies or [None] * len(params)
    penalized = [_has_penalty(p, r) for p, r in zip(params, replies)]
    plain = [p.temperature <= 0 and not pen for p, pen in zip(params, penalized)]
    if logits.device.type == "cpu":
        rows = logits.float().numpy()
        chosen = [int(rows[i].argmax()) if plain[i] else 0 for i in range(len(params))]
    else:  # greedy on the device; only the rows drawn from cross to the host
        chosen = logits.argmax(dim=-1).tolist()
        rest = [i for i, p in enumerate(plain) if not p]
        rows = dict(zip(rest, logits[rest].float().cpu().numpy())) if rest else {}
    for i, (p, noise, reply) in enumerate(zip(params, noises, replies)):
        if plain[i]:
            continue
        if p.temperature > 0 and kernels is not None:
            chosen[i] = kernels.draw(rows[i], p, noise.uniform(positions[i]), reply if penalized[i] else None)
            continue
        row = penalize(rows[i], p, reply) if penalized[i] else rows[i]
        chosen[i] = int(row.argmax()) if p.temperature <= 0 else _draw(row, p, noise.uniform(positions[i]))
    return chosen
