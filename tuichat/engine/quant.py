"""Linear weights as a GGUF file stores them (Q8_0, Q4_0, Q4_1 blocks of 32), for the CPU kernels.

A CPU decode step is bound by reading the weights; dequantized to bf16, SmolLM2-135M's Q4_1 file becomes 269
MB a step where its own blocks are 96. The kernels (vector_linear.c) either expand a tile of blocks at a time
into fp32, exactly as gguf's own dequantization does, or (x86 with AVX2) quantize the activations to int8 per
block of 32 and sum int8 products, as llama.cpp does: faster, and it moves the logits by more than bf16
rounding does (scripts/fidelity.py measures the argmax agreement with float32, next to llama.cpp's).

Which GGUF tensor is which linear comes from gguf's own name map for the file's architecture. Each packed
tensor is checked against the weights transformers loaded (its converted, bf16 copy) on a sample of rows,
which also finds the row order llama.cpp's converter gives Q and K (a permutation transformers undoes
when it dequantizes); a tensor whose rows do not match is left in bf16, never served in a wrong order.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

BF16 = 30  # ggml's type number for bf16; the quantized ones below are ggml's as well
PACK_VERSION = "2"  # of the cached layout: bump when CpuKernels.pack changes what it writes
BLOCK_BYTES = {2: 18, 3: 20, 8: 34}  # Q4_0, Q4_1, Q8_0: bytes per block of 32 weights
NAMES = {30: "bfloat16", 2: "Q4_0", 3: "Q4_1", 8: "Q8_0"}
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
           "mlp.up_proj", "mlp.down_proj")


@dataclass(frozen=True)
class PackedWeight:
    """A linear's weight as the kernels read it: bf16 [N, K], or N rows of K / 32 GGUF blocks (uint8, in the
    kernels' own order of the same bytes: CpuKernels.pack)."""

    data: torch.Tensor
    format: int
    out_features: int
    in_features: int

    @classmethod
    def of(cls, weight: torch.Tensor) -> "PackedWeight":
        return cls(weight.contiguous(), BF16, weight.shape[0], weight.shape[1])

    @property
    def bytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    @staticmethod
    def cat(parts: list["PackedWeight"]) -> "PackedWeight | None":
        """Parts stacked by rows (q, k and v into one linear), or None if their formats differ."""
        if len({p.format for p in parts}) != 1 or len({p.in_features for p in parts}) != 1:
            return None
        return PackedWeight(torch.cat([p.data for p in parts]), parts[0].format,
                            sum(p.out_features for p in parts), parts[0].in_features)


def _llama_rows(n_rows: int, heads: int) -> np.ndarray:
    """The row order that undoes llama.cpp's Q/K permutation (what transformers' LlamaTensorProcessor does)."""
    dim = n_rows // heads // 2
    return np.arange(n_rows).reshape(heads, dim, 2).swapaxes(2, 1).reshape(n_rows)


def _matches(blocks: np.ndarray, qtype, weight: torch.Tensor, rows: np.ndarray) -> bool:
    """Do the sampled GGUF rows, dequantized and rounded as the loaded weights were, equal those weights?"""
    from gguf.quants import dequantize

    sample = sorted({0, 1, len(rows) // 2, len(rows) - 2, len(rows) - 1})
    expected = torch.from_numpy(dequantize(blocks[rows[sample]], qtype).astype(np.float32))
    return torch.equal(expected.to(weight.dtype), weight[sample].detach())


def from_gguf(path: str | Path, model, kernel) -> dict[str, PackedWeight]:
    """{parameter name: packed weight} for each decoder linear and the lm_head whose GGUF tensor is Q8_0, Q4_0
    or Q4_1 and whose rows match the model's own weights, laid out for `kernel` (cpu_kernel.CpuKernels);
    everything else keeps the model's weights."""
    from gguf import MODEL_ARCH_NAMES, GGUFReader, get_tensor_name_map

    reader = GGUFReader(str(path))
    arch_field = reader.fields.get("general.architecture")
    arch_name = bytes(arch_field.parts[arch_field.data[0]]).decode() if arch_field else ""
    arch = next((key for key, value in MODEL_ARCH_NAMES.items() if value == arch_name), None)
    if arch is None:
        return {}
    layers = model.model.layers
    names = get_tensor_name_map(arch, len(layers))
    tensors = {t.name: t for t in reader.tensors}
    config = model.config
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    wanted = {f"model.layers.{i}.{linear}": getattr(getattr(layer, linear.split(".")[0]), linear.split(".")[1])
              for i, layer in enumerate(layers) for linear in LINEARS}
    wanted["lm_head"] = model.lm_head
    packed = {}
    for module_name, module in wanted.items():
        candidates = [f"{names.get_name(module_name)}.weight"]
        if module_name == "lm_head":
            candidates.append("token_embd.weight")  # tied embeddings: the rows check below tells
        tensor = next((tensors[c] for c in candidates if c in tensors), None)
        weight = getattr(module, "weight", None)
        if tensor is None or int(tensor.tensor_type) not in BLOCK_BYTES or weight is None or weight.dim() != 2:
            continue
        blocks = np.asarray(tensor.data)
        out_features, in_features = weight.shape
        if blocks.shape != (out_features, in_features // 32 * BLOCK_BYTES[int(tensor.tensor_type)]):
            continue
        orders = [np.arange(out_features)]
        if module_name.endswith(("q_proj", "k_proj")):
            orders.append(_llama_rows(out_features, heads if module_name.endswith("q_proj") else kv_heads))
        rows = next((order for order in orders if _matches(blocks, tensor.tensor_type, weight, order)), None)
        if rows is None:
            continue
        data = kernel.pack(np.ascontiguousarray(blocks[rows]), int(tensor.tensor_type), in_features)
        packed[module_name] = PackedWeight(data, int(tensor.tensor_type), out_features, in_features)
    return packed


def cached_from_gguf(path: str | Path, model, kernel, cache: Path | None) -> dict[str, PackedWeight]:
    """from_gguf, remembered in `cache` (a safetensors file beside the converted model, which is keyed by the
    GGUF's content): reading the GGUF's metadata alone takes seconds, the packed weights load in milliseconds."""
    from safetensors import SafetensorError, safe_open
    from safetensors.torch import save_file

    if cache is not None and cache.is_file():
        try:
            with safe_open(str(cache), "pt") as file:
                meta = file.metadata() or {}
                if meta.get("version") == PACK_VERSION:
                    packed = {}
                    params = dict(model.named_parameters(remove_duplicate=False))  # tied: lm_head too
                    for name in file.keys():
                        format, out_features, in_features, layout = meta[name].split(",")
                        format, out_features, in_features = int(format), int(out_features), int(in_features)
                        weight = params.get(f"{name}.weight")
                        if (weight is None or tuple(weight.shape) != (out_features, in_features)
                                or layout != kernel.layout(format, in_features)):
                            packed = None
                            break
                        # A copy, not a view of the mapped file: a file changed under a running engine
                        # must not change (or, cut short, fault) what it serves.
                        packed[name] = PackedWeight(file.get_tensor(name).clone(), format, out_features, in_features)
                    if packed is not None:
                        return packed
        except (OSError, ValueError, KeyError, SafetensorError):  # unreadable, damaged or another version: pack again
            pass
    packed = from_gguf(path, model, kernel)
    if cache is not None and packed:
        meta = {name: f"{w.format},{w.out_features},{w.in_features},{kernel.layout(w.format, w.in_features)}"
                for name, w in packed.items()}
        temporary = cache.with_name(cache.name + f".tmp-{os.getpid()}")
        try:
            save_file({name: w.data for name, w in packed.items()}, str(temporary), {"version": PACK_VERSION, **meta})
            os.replace(temporary, cache)
        except OSError:  # a read-only cache: packing again next time is only slower
            temporary.unlink(missing_ok=True)
    return packed
