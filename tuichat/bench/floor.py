"""The floor: the bytes a decode step reads (tuichat's quantized weights; transformers' dense ones) / the
measured memory bandwidth."""

from __future__ import annotations

import time
from typing import Any

import numpy as np


class BandwidthProbe:
    """Sums over a buffer allocated once: the bandwidth at this moment, to sample between a scenario's
    requests. This machine's bandwidth swings by 2x within a run as its neighbours come and go, so a TPOT is
    compared with the floor at the bandwidth measured around its own requests, not at the run's best moment.
    On the CPU the buffer is in 2 MB pages where the system gives them, as tuichat's weights are: 4 KB ones read
    a fifth slower on these VMs (docs/design/kernels.md), a floor slower than what the memory gives."""

    def __init__(self, device, megabytes: int = 512) -> None:
        import torch

        self.device = device
        count = megabytes * 2**20 // 4
        if device.type == "cpu":  # in 2 MB pages where Linux gives them, as the weights tuichat reads in place
            from tuichat.engine.heap import WeightArena

            self.buffer = torch.from_numpy(WeightArena().array((count,), np.float32))
            self.buffer.fill_(1.0)  # faults the pages in
        else:
            self.buffer = torch.ones(count, dtype=torch.float32, device=device)
        self.buffer.sum().item()

    def sample(self, reads: int = 3) -> float:
        """Bytes/s: the best of a few reads of the buffer (on a fresh thread the first read runs well below what
        the memory gives: measured 32 against 39 GB/s)."""
        import torch

        best = float("inf")
        for _ in range(reads):
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            start = time.perf_counter()
            self.buffer.sum().item()
            best = min(best, time.perf_counter() - start)
        return self.buffer.numel() * 4 / best


def measure_bandwidth(device, megabytes: int = 512, repeats: int = 5) -> float:
    """Read bandwidth in bytes/s: the best of a few torch sums over one large buffer, once its pages are in."""
    return BandwidthProbe(device, megabytes).sample(repeats)


def step_floor(weights: str, weight_bytes: int, bandwidth: float) -> dict[str, Any]:
    step_ms = weight_bytes / bandwidth * 1000
    return {"weights": weights, "weight_bytes": weight_bytes, "decode_step_ms": step_ms, "decode_tokens_per_s": 1000 / step_ms}
