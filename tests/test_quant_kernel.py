"""The linear over GGUF-quantized weights (Q8_0, Q4_0, Q4_1; Q5_0 and Q5_1 in their own blocks where the tiled path
is built), on every build this CPU can run: its result is the
reference computation of its own method to bf16 rounding — the weights dequantized exactly with fp32 inputs
(the "fp32" method), or the inputs quantized to int8 per block of 32 as llama.cpp does (the "int8" methods) —
and a row's result does not depend on the rows beside it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tuichat.engine import quant

FORMATS = {"Q4_0": 2, "Q4_1": 3, "Q8_0": 8, "Q5_0": 6, "Q5_1": 7}
FIVE_BIT = (6, 7)  # the tiles' and the pairs' only: a build with neither re-cuts them (test_mapped, test_gguf_engine)


def quantized(format: int, n: int, k: int, seed: int):
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    rng = np.random.default_rng(seed)
    weights = rng.standard_normal((n, k), dtype=np.float32) * 0.05
    return np.ascontiguousarray(quantize(weights, GGMLQuantizationType(format)))


def decode(blocks: np.ndarray, format: int, k: int):
    """(scale d, minimum m or None, integer quants q [N, K]) of GGUF blocks, read straight from the bytes."""
    n = blocks.shape[0]
    b = blocks.reshape(n, k // 32, quant.BLOCK_BYTES[format])
    d = b[:, :, 0:2].copy().view(np.float16).astype(np.float64)[..., 0]
    if format in FIVE_BIT:  # d, (m,) 32 fifth bits, then the nibbles: bit j of qh is weight j's
        head = 4 if format == 7 else 2
        qh = b[:, :, head:head + 4].copy().view(np.uint32)[..., 0]
        qs = b[:, :, head + 4:]
        fifth = (qh[..., None] >> np.arange(32, dtype=np.uint32)) & 1
        q = (np.concatenate([qs & 15, qs >> 4], axis=2) | (fifth << 4)).astype(np.int64).reshape(n, k)
        m = b[:, :, 2:4].copy().view(np.float16).astype(np.float64)[..., 0] if format == 7 else None
        return d, m, q
    if format == 8:
        return d, None, b[:, :, 2:].view(np.int8).astype(np.int64).reshape(n, k)
    qs = b[:, :, 4 if format == 3 else 2:]
    q = np.concatenate([qs & 15, qs >> 4], axis=2).astype(np.int64).reshape(n, k)
    m = b[:, :, 2:4].copy().view(np.float16).astype(np.float64)[..., 0] if format == 3 else None
    return d, m, q


def reference(x: torch.Tensor, blocks: np.ndarray, format: int, k: int, method: str) -> np.ndarray:
    """float64 result of the kernel's method."""
    d, m, q = decode(blocks, format, k)
    if format in (2, 6):
        q = q - (8 if format == 2 else 16)
    weights = (q.reshape(len(q), -1, 32) * d[..., None]).reshape(len(q), k)
    if m is not None:
        weights = weights + np.repeat(m, 32, axis=1)
    xs = x.float().numpy().astype(np.float64)
    if method == "fp32":
        return xs @ weights.T
    # int8: per input block, dx = max|x| / 127 (fp32), q_x = round-half-even(x * (1 / dx)) in fp32
    xf = x.float().numpy().reshape(len(x), -1, 32)
    dx = (np.abs(xf).max(axis=2) / np.float32(127)).astype(np.float32)
    inverse = np.where(dx > 0, np.float32(1) / np.where(dx > 0, dx, 1), 0).astype(np.float32)
    qx = np.rint(xf * inverse[..., None]).astype(np.int64)
    qw = q.reshape(len(q), -1, 32)
    dots = np.einsum("mbt,nbt->mnb", qx, qw).astype(np.float64)
    out = np.einsum("mnb,nb,mb->mn", dots, d, dx.astype(np.float64))
    if m is not None:
        out += np.einsum("nb,mb->mn", m, dx.astype(np.float64) * qx.sum(axis=2))
    return out


def packed(kernels, blocks: np.ndarray, fmt: int, k: int):
    """The blocks laid out for `kernels`; a 5-bit format where neither the tiles nor the pairs take it (no AVX2, or
    K not a multiple of 64 without the tiles) is refused (skipped)."""
    if fmt in FIVE_BIT and kernels.layout(fmt, k) not in ("tiles", "pairs"):
        with pytest.raises(ValueError):
            kernels.pack(blocks, fmt, k)
        pytest.skip("Q5_0 and Q5_1 in their own blocks are the tiles' (512-bit VNNI) and the pairs' (AVX2, K % 64 == 0)")
    return kernels.pack(blocks, fmt, k)


def ulps_off(y: torch.Tensor, exact: np.ndarray, magnitude: np.ndarray) -> np.ndarray:
    """bf16 steps between y and the float64 result, widened by fp32 summation error where terms cancel."""
    exact = torch.from_numpy(exact)
    step = exact.abs().clamp_min(1e-30).log2().floor().exp2() / 128
    return ((y.double() - exact).abs() / (step + torch.from_numpy(magnitude) * 2.0**-22)).round().numpy()


@pytest.mark.parametrize("name", list(FORMATS))
@pytest.mark.parametrize("n,k", [(16, 64), (48, 576), (96, 1536), (32, 96)])
@pytest.mark.parametrize("rows", [1, 3, 8, 17, 66])  # 66: 512-bit tiles two at a time, and a lone one where odd
def test_quantized_linear_is_its_methods_reference_to_bf16_rounding(kernels, name, n, k, rows):
    fmt = FORMATS[name]
    blocks = quantized(fmt, n, k, seed=n * k + fmt)
    weight = quant.PackedWeight(packed(kernels, blocks, fmt, k), fmt, n, k)
    gen = torch.Generator().manual_seed(rows * 7 + k)
    x = torch.randn(rows, k, generator=gen).bfloat16()
    method = "fp32" if kernels.quant_math(fmt, k) == "fp32" else "int8"
    if kernels.layout(fmt, k) in ("pairs", "signed pairs"):
        assert k % 64 == 0  # that int8 layout pairs blocks
    y = kernels.linear(x, weight, None)
    exact = reference(x, blocks, fmt, k, method)
    d, m, q = decode(blocks, fmt, k)
    magnitude = np.abs(x.float().numpy()).astype(np.float64) @ (np.abs(q) * np.repeat(np.abs(d), 32, axis=1) + (
        np.repeat(np.abs(m), 32, axis=1) if m is not None else 0)).T * k
    off = ulps_off(y, exact, magnitude)
    assert off.max() <= 1 and (off == 0).mean() >= 0.97, (method, off.max())


@pytest.mark.parametrize("name", list(FORMATS))
@pytest.mark.parametrize("n,k", [(48, 576), (32, 96)])
def test_float32_activations_in_and_out_are_the_reference_to_fp32_rounding(kernels, name, n, k):
    """The packed decoder's path (decoder.c keeps activations fp32): the inputs are not rounded to bf16 first and
    the outputs not rounded after, so the result is its method's reference within fp32 summation error, a
    few hundred times closer than one bf16 step."""
    fmt = FORMATS[name]
    blocks = quantized(fmt, n, k, seed=n + k + fmt)
    weight = quant.PackedWeight(packed(kernels, blocks, fmt, k), fmt, n, k)
    x = torch.randn(9, k, generator=torch.Generator().manual_seed(k))  # fp32, not bf16 values
    assert not torch.equal(x, x.bfloat16().float())
    y = kernels.linear(x, weight, None)
    assert y.dtype is torch.float32
    exact = reference(x, blocks, fmt, k, "fp32" if kernels.quant_math(fmt, k) == "fp32" else "int8")
    d, m, q = decode(blocks, fmt, k)
    magnitude = np.abs(x.numpy()).astype(np.float64) @ (np.abs(q) * np.repeat(np.abs(d), 32, axis=1) + (
        np.repeat(np.abs(m), 32, axis=1) if m is not None else 0)).T
    assert (np.abs(y.double().numpy() - exact) <= magnitude * 2.0**-20).all()


@pytest.mark.parametrize("name", list(FORMATS))
def test_a_rows_result_does_not_depend_on_its_batch(kernels, name):
    fmt, k = FORMATS[name], 576
    blocks = quantized(fmt, 80, k, seed=fmt)
    weight = quant.PackedWeight(packed(kernels, blocks, fmt, k), fmt, 80, k)
    x = torch.randn(70, k, generator=torch.Generator().manual_seed(3))
    for dtype in (torch.float32, torch.bfloat16):  # fp32 out: bf16's rounding hides a sum's last bits
        xs = x.to(dtype)
        for together in (kernels.linear(xs, weight, None), kernels.linear(xs[:21], weight, None)):  # 70: tile pairs
            for row in (0, 4, 13, 20):
                assert torch.equal(kernels.linear(xs[row : row + 1], weight, None)[0], together[row])
            assert torch.equal(kernels.linear(xs[5:9], weight, None), together[5:9])


@pytest.mark.parametrize("rows", [2, 19, 67])  # the tiles (67: two at a time); AVX2's GEMM (a vector at a time)
def test_a_bias_is_added_once(kernels, rows):
    fmt, k = FORMATS["Q4_1"], 128
    blocks = quantized(fmt, 32, k, seed=9)
    weight = quant.PackedWeight(kernels.pack(blocks, fmt, k), fmt, 32, k)
    x = torch.randn(rows, k).bfloat16()
    bias = (torch.randn(32) * 4).bfloat16()
    with_bias, without = kernels.linear(x, weight, bias), kernels.linear(x, weight, None)
    assert (with_bias.float() - without.float() - bias.float()).abs().max() <= 0.02 * (bias.float().abs().max() + 1)
