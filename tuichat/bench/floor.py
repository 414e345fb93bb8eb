"""The floor: the bytes a decode step reads (tuichat's quantized weights; transformers' dense ones) / the
measured memory bandwidth."""

from __future__ import annotations

import time
from typing import Any


class BandwidthProbe:
    """Sums over a buffer allocated once: the bandwidth at this moment, to sample between a scenario's
    requests. This machine's bandwidth swings by 2x within a run as its neighbours come and go, so a TPOT is
    compared with the floor at the bandwidth measured around its own requests, not at the run's best moment."""

    def __init__(self, device, megabytes: int = 512) -> None:
        import torch

        self.device = device
        self.buffer = torch.ones(megabytes * 2**20 // 4, dtype=torch.float32, device=device)
        self.buffer.sum().item()  # faults the pages in

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
