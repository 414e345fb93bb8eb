"""Faster linears for transformers' decoder layers, without touching their forward code.

At decode time a CPU step is dominated by per-call matmul overhead rather than by bytes:
- q, k and v (and gate and up) are small matmuls of the same input. transformers has no switch to fuse them
  for standard models, so we concatenate their weights into one matmul and let the original attribute
  names hand out slices of its result. The layer's forward calls q, k, v (gate, up) one after another on
  the same tensor; the first call computes all of them, the others take their slice.
- For models decoder.c does not cover, a step's rows go through the AMX linear of the CPU kernels when the
  model is bf16 on a CPU that has AMX; otherwise a single row goes through a matrix-vector kernel: torch's
  bf16 gemv reads the weights about twice as fast as its gemm does for one row.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from tuichat.engine.cpu.native import MAX_ROWS, CpuKernels

_GROUPS = {"self_attn": ("q_proj", "k_proj", "v_proj"), "mlp": ("gate_proj", "up_proj")}


def linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, kernel: CpuKernels | None = None
) -> torch.Tensor:
    rows = x.numel() // x.shape[-1]
    if kernel is not None and rows <= MAX_ROWS:
        return kernel(x, weight, bias)
    if rows == 1 and x.device.type == "cpu":
        y = torch.mv(weight, x.reshape(-1))
        y = y if bias is None else y + bias
        return y.view(*x.shape[:-1], weight.shape[0])
    return F.linear(x, weight, bias)


class DecodeLinear(nn.Linear):
    """nn.Linear whose forward takes the decode paths for few rows; swapped in by class, weights untouched."""

    kernel: CpuKernels | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.kernel)


class FusedLinear(nn.Module):
    def __init__(self, linears: list[nn.Linear]) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.cat([l.weight.data for l in linears]), requires_grad=False)
        biases = [l.bias for l in linears]
        self.bias = None
        if any(b is not None for b in biases):
            parts = [b.data if b is not None else l.weight.new_zeros(l.out_features) for b, l in zip(biases, linears)]
            self.bias = nn.Parameter(torch.cat(parts), requires_grad=False)
        self.sizes = [l.out_features for l in linears]
        self.kernel: CpuKernels | None = None
        self._input: torch.Tensor | None = None
        self._parts: tuple[torch.Tensor, ...] = ()

    def part(self, x: torch.Tensor, index: int) -> torch.Tensor:
        if index == 0 or x is not self._input:
            self._input, self._parts = x, linear(x, self.weight, self.bias, self.kernel).split(self.sizes, dim=-1)
        out = self._parts[index]
        if index == len(self.sizes) - 1:
            self._input, self._parts = None, ()  # don't keep activations alive between steps
        return out


class FusedSlice(nn.Module):
    """Stands where one of the original linears was."""

    def __init__(self, fused: FusedLinear, index: int) -> None:
        super().__init__()
        self.index = index
        self._fused = [fused]  # a list, so the shared module is not registered (and saved) once per slice

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._fused[0].part(x, self.index)


def speed_up_linears(model, kernel: CpuKernels | None = None) -> int:
    """Fuse q/k/v and gate/up in every decoder layer that has them, and give every remaining plain linear
    the decode paths; `kernel` goes to each linear whose weights suit it. Returns how many groups were fused."""
    fused = 0
    for layer in getattr(getattr(model, "model", None), "layers", ()):
        for part_name, names in _GROUPS.items():
            part = getattr(layer, part_name, None)
            linears = [getattr(part, n, None) for n in names]
            if part is None or not all(isinstance(l, nn.Linear) for l in linears):
                continue
            if any(l.weight.device.type == "meta" for l in linears):
                continue  # offloaded by accelerate: its hooks bring each linear's weights in when it runs
            group = FusedLinear(linears)
            part.add_module("fused_" + "_".join(n.removesuffix("_proj") for n in names), group)
            for index, name in enumerate(names):
                setattr(part, name, FusedSlice(group, index))
            fused += 1
    for module in model.modules():
        if type(module) is nn.Linear:
            module.__class__ = DecodeLinear
        if isinstance(module, (DecodeLinear, FusedLinear)) and kernel is not None and kernel.fits(module.weight, module.bias):
            module.kernel = kernel
    return fused
