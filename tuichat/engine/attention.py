"""Paged attention, plugged into transformers' own model classes through AttentionInterface.

transformers' built-in kernels assume one dense cache per sequence; we hand the model all new tokens of
all sequences flattened into one row and let this function (a) scatter their K/V into the block pool and
(b) attend each sequence to its own cached keys. What it needs per step lives in a StepContext set by the
runner (as nano-vllm does), so the model code stays untouched.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

ATTENTION_NAME = "tuichat_paged"


@dataclass
class PrefillSpan:
    offset: int  # first row of this sequence in the flattened batch
    length: int  # rows (new tokens) of this sequence
    start: int  # position of its first new token: keys [0, start) come from the cache
    context_slots: torch.Tensor | None = None  # slots of positions [0, start + length), when start > 0
    mask: torch.Tensor | None = None  # [length, start + length] causal mask with the cache offset


@dataclass
class StepContext:
    k_cache: list[torch.Tensor]
    v_cache: list[torch.Tensor]
    slot_mapping: torch.Tensor  # [T] where each new token's K/V goes
    num_decode: int = 0  # the first num_decode rows are single-token decodes
    decode_slots: torch.Tensor | None = None  # [B, Lmax] slots of each decode's context (padded)
    decode_mask: torch.Tensor | None = None  # [B, 1, 1, Lmax] True where a key is real
    prefills: list[PrefillSpan] = field(default_factory=list)


_local = threading.local()  # one engine thread per model; contexts never cross threads


def set_context(ctx: StepContext | None) -> None:
    _local.ctx = ctx


def _gather(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """cache[slots], through index_select on the flat slot list: 4–5x faster on CPU than advanced indexing
    with a 2-D index (129 vs 27 us for 8 x 300 slots here)."""
    return cache.index_select(0, slots.reshape(-1)).view(*slots.shape, *cache.shape[1:])


def paged_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    ctx: StepContext = _local.ctx
    layer = module.layer_idx
    k_cache, v_cache = ctx.k_cache[layer], ctx.v_cache[layer]
    # query [1, H, T, D]; key/value [1, KV, T, D], RoPE already applied.
    new_k = key[0].transpose(0, 1)
    new_v = value[0].transpose(0, 1)
    k_cache.index_copy_(0, ctx.slot_mapping, new_k.to(k_cache.dtype))
    v_cache.index_copy_(0, ctx.slot_mapping, new_v.to(v_cache.dtype))

    num_heads, num_tokens, head_dim = query.shape[1], query.shape[2], query.shape[3]
    out = query.new_empty(num_tokens, num_heads, head_dim)
    b = ctx.num_decode
    if b:
        q = query[0, :, :b].transpose(0, 1).unsqueeze(2)  # [B, H, 1, D]
        k = _gather(k_cache, ctx.decode_slots).transpose(1, 2)  # [B, KV, Lmax, D]
        v = _gather(v_cache, ctx.decode_slots).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=ctx.decode_mask, scale=scaling, enable_gqa=True)
        out[:b] = o[:, :, 0]
    for span in ctx.prefills:
        rows = slice(span.offset, span.offset + span.length)
        q = query[:, :, rows]
        if span.start == 0:  # nothing cached before: attend to the fresh keys, plain causal
            o = F.scaled_dot_product_attention(
                q, key[:, :, rows], value[:, :, rows], is_causal=True, scale=scaling, enable_gqa=True
            )
        else:
            k = _gather(k_cache, span.context_slots).transpose(0, 1).unsqueeze(0)  # [1, KV, L, D]
            v = _gather(v_cache, span.context_slots).transpose(0, 1).unsqueeze(0)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=span.mask, scale=scaling, enable_gqa=True)
        out[rows] = o[0].transpose(0, 1)
    return out.unsqueeze(0), None


def _no_mask(*args, **kwargs):
    return None  # the attention function knows each sequence's boundaries; a dense mask would be waste


def register() -> str:
    from transformers import AttentionInterface, AttentionMaskInterface

    AttentionInterface.register(ATTENTION_NAME, paged_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, _no_mask)
    return ATTENTION_NAME
