"""Q4_K, Q5_K and Q6_K weights read in the file's own layout (ggml's super-blocks of 256, no re-cut), on every build
this CPU can run: the result is gguf's own dequantization of the same bytes times the inputs quantized to
int8 per 256 (the kernel's method), to fp32 summation error; and a row's result does not depend on its batch,
nor on which of the three kernels (row tiles for up to 4 rows, a lane per row up to 32, a GEMM for more) ran
it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tuichat.engine.quant import PackedWeight

FORMATS = {"Q4_K": (12, 144, [(0, 2), (2, 4)]), "Q5_K": (13, 176, [(0, 2), (2, 4)]), "Q6_K": (14, 210, [(208, 210)])}


def blocks(name: str, n: int, k: int, seed: int) -> np.ndarray:
    """Rows of random super-blocks: every byte pattern is a valid block but a scale's; those are fp16 values of
    a real file's magnitude."""
    fmt, size, scales = FORMATS[name]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(n, k // 256, size), dtype=np.uint8)
    for start, end in scales:
        raw[..., start:end] = rng.uniform(1e-3, 2e-2, size=(n, k // 256, 1)).astype(np.float16).view(np.uint8)
    return raw.reshape(n, -1)


def reference(x: torch.Tensor, raw: np.ndarray, name: str, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(float64 result of the kernel's method, the magnitude its fp32 sums may be off by)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    weights = dequantize(raw, GGMLQuantizationType(FORMATS[name][0])).reshape(len(raw), k).astype(np.float64)
    xf = x.float().numpy().reshape(len(x), -1, 256)
    d = (np.abs(xf).max(axis=2) / np.float32(127)).astype(np.float32)
    inverse = np.where(d > 0, np.float32(1) / np.where(d > 0, d, 1), 0).astype(np.float32)
    qx = np.rint(xf * inverse[..., None]) * d[..., None].astype(np.float64)
    qx = qx.reshape(len(x), k)
    return qx @ weights.T, np.abs(qx) @ np.abs(weights).T


def in_place_or_skip(kernels, name: str, k: int) -> None:
    """Q5_K is read in place by the AVX2 builds only (the 512-bit ones re-cut it into their tiles)."""
    if kernels.layout(FORMATS[name][0], k) != "in place":
        pytest.skip(f"this build does not read {name} in place")


@pytest.mark.parametrize("name", list(FORMATS))
@pytest.mark.parametrize(
    "n,k,rows", [(4, 256, 1), (64, 512, 3), (36, 1536, 17), (8, 768, 8), (48, 768, 21), (32, 768, 67), (16, 512, 65)]
)
def test_a_k_quant_linear_is_gguf_dequantized_times_its_int8_inputs(kernels, name, n, k, rows):
    in_place_or_skip(kernels, name, k)
    raw = blocks(name, n, k, seed=n * k + rows)
    weight = PackedWeight(torch.from_numpy(raw), FORMATS[name][0], n, k)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows + k))
    y = kernels.linear(x, weight, None)
    exact, magnitude = reference(x, raw, name, k)
    assert (np.abs(y.double().numpy() - exact) <= magnitude * 2.0**-18).all()
    y16 = kernels.linear(x.bfloat16(), weight, None)  # bf16 in and out: the same sums, rounded
    exact16, _ = reference(x.bfloat16(), raw, name, k)
    assert torch.allclose(y16.double(), torch.from_numpy(exact16), rtol=2**-7, atol=magnitude.max() * 2.0**-16)


@pytest.mark.parametrize("name", list(FORMATS))
def test_a_k_quant_rows_result_does_not_depend_on_its_batch(kernels, name):
    """80 rows go through the GEMM (AVX2's takes Q6_K from 64 rows; 512-bit VNNI's 48 weight rows are a tile of 32
    and a last of 16), 6, 17 or 32 a lane each (512-bit VNNI: tiles of 8 rows, two at a time and one alone), one
    row or four through the row tiles: the same outputs, bit for bit."""
    k = 768
    in_place_or_skip(kernels, name, k)
    raw = blocks(name, 48, k, seed=5)
    weight = PackedWeight(torch.from_numpy(raw), FORMATS[name][0], 48, k)
    x = torch.randn(80, k, generator=torch.Generator().manual_seed(3))
    for dtype in (torch.float32, torch.bfloat16):
        together = kernels.linear(x.to(dtype), weight, None)
        for row in (0, 4, 12, 36, 69):
            assert torch.equal(kernels.linear(x[row : row + 1].to(dtype), weight, None)[0], together[row])
        assert torch.equal(kernels.linear(x[5:11].to(dtype), weight, None), together[5:11])
        assert torch.equal(kernels.linear(x[7:11].to(dtype), weight, None), together[7:11])
        assert torch.equal(kernels.linear(x[3:20].to(dtype), weight, None), together[3:20])
        assert torch.equal(kernels.linear(x[10:42].to(dtype), weight, None), together[10:42])
        for rows in range(65, 73):  # the GEMM's passes of input rows and each remainder after them
            assert torch.equal(kernels.linear(x[:rows].to(dtype), weight, None), together[:rows])


def test_a_shape_the_k_quant_linear_cannot_take_is_refused(kernels):
    raw = blocks("Q4_K", 6, 256, seed=1)  # rows in tiles of 4: 6 is not
    with pytest.raises(RuntimeError, match="any_linear failed"):
        kernels.linear(torch.randn(1, 256), PackedWeight(torch.from_numpy(raw), 12, 6, 256), None)
    k = 129 * 256  # one super-block more than a tile keeps the sums of
    assert kernels.layout(12, k) != "in place"
    with pytest.raises(RuntimeError, match="any_linear failed"):
        kernels.linear(torch.randn(1, k), PackedWeight(torch.from_numpy(blocks("Q4_K", 4, k, seed=2)), 12, 4, k), None)
