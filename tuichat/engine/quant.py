"""Linear weights as a GGUF file stores them (Q8_0, Q4_0, Q4_1 blocks of 32; Q5_0, Q5_1, Q4_K, Q5_K and Q6_K
re-cut into blocks of 32), for the CPU kernels.

A CPU decode step is bound by reading the weights; dequantized to bf16, SmolLM2-135M's Q4_1 file becomes 269
MB a step where its own blocks are 96. The kernels (cpu/csrc/linear_quant.c and arch/) either expand a tile of
blocks at a time into fp32, exactly as gguf's own dequantization does, or (x86 with AVX2) quantize the
activations to int8 per block of 32 and sum int8 products, as llama.cpp does: faster, and it moves the logits
by more than bf16 rounding does (scripts/fidelity.py measures the argmax agreement with float32, next to llama.cpp's).

Which GGUF tensor is which linear comes from gguf's own name map for the file's architecture. Each packed
tensor is checked against the weights transformers loaded (its converted, bf16 copy) on a sample of rows,
which also finds the row order llama.cpp's converter gives Q and K (a permutation transformers undoes
when it dequantizes); a tensor whose rows do not match is left in bf16, never served in a wrong order.

A dense (bf16 or float32) checkpoint's linears can be quantized into the same blocks at load (--quant int8 or
int4: from_dense), with gguf's own quantize, so that the kernels serve them as they serve a GGUF's.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

BF16 = 30  # ggml's type number for bf16; the quantized ones below are ggml's as well
PACK_VERSION = "4"  # of the cached layout: bump when CpuKernels.pack changes what it writes
# Bytes per block of 32 weights as the kernels are handed them: Q4_0, Q4_1, Q8_0 as GGUF stores them (and Q5_0,
# Q5_1 where the tiled path is built: elsewhere they are re-cut), and the 5-bit and K-quant types re-cut (recut):
# ids 100 + the GGUF type's.
BLOCK_BYTES = {2: 18, 3: 20, 6: 22, 7: 24, 8: 34, 106: 40, 107: 40, 112: 24, 113: 40, 114: 36}
NAMES = {30: "bfloat16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 106: "Q5_0", 107: "Q5_1", 112: "Q4_K",
         113: "Q5_K", 114: "Q6_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K"}
RECUT = {6: 106, 7: 107, 12: 112, 13: 113, 14: 114}  # GGUF's Q5_0, Q5_1, Q4_K, Q5_K, Q6_K: their re-cut ids
# Q4_K, Q5_K and Q6_K as the file holds them (bytes per super-block of 256), where the kernels read them in place
# (linear_kquant.c: Q5_K on AVX2 builds only; a GGUF served from its map, engine/mapped.py).
IN_PLACE = {12: 144, 13: 176, 14: 210}


def row_bytes(format: int, in_features: int) -> int:
    """The bytes of one row of `in_features` weights in `format` as the kernels are handed it."""
    if format in IN_PLACE:
        return in_features // 256 * IN_PLACE[format]
    return in_features // 32 * BLOCK_BYTES[format]

LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
           "mlp.up_proj", "mlp.down_proj")
# --quant for a dense checkpoint: (the blocks its decoder linears are quantized to, the lm_head's), groups of 32
# weights each. int4 is Q4_1 (a scale and a minimum per block: 20 bytes) rather than Q4_0 (a scale, levels
# symmetric around 0: 18 bytes), for two bytes more a block: a block's weights are seldom symmetric, and Q4_0
# spends levels on the side they do not reach. Its error was the smaller on every measure taken (the weights'
# RMS error, teacher-forced logits, argmax agreement with float32: docs/design/kernels.md). int4's lm_head stays Q8_0, as
# llama.cpp keeps its output tensor at 6 or 8 bits for its 4-bit types: a 4-bit one cost far more agreement
# than its bytes save.
QUANT_FORMATS = {"int8": (8, 8), "int4": (3, 8)}


@dataclass(frozen=True)
class PackedWeight:
    """A linear's weight as the kernels read it: bf16 [N, K], or N rows of K / 32 GGUF blocks (uint8, in the
    kernels' own order of the same bytes: CpuKernels.pack)."""

    data: torch.Tensor
    format: int
    out_features: int
    in_features: int

    @classmethod
    def of(cls, weight: torch.Tensor) -> PackedWeight:
        return cls(weight.contiguous(), BF16, weight.shape[0], weight.shape[1])

    @property
    def bytes(self) -> int:
        return self.data.numel() * self.data.element_size()

    @staticmethod
    def cat(parts: list[PackedWeight]) -> PackedWeight | None:
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


def recut(blocks: np.ndarray, qtype: int) -> np.ndarray:
    """Q5_0, Q5_1, Q4_K, Q5_K or Q6_K rows re-cut into blocks of 32 that the kernels' tiles take as they take Q4_1
    and Q8_0, each weight still gguf's own dequantized value, bit for bit:
    - Q5_0, Q5_1, Q4_K, Q5_K: each block's own scale and minimum in fp32 (d and -16 d, d and m, or the K-quants'
      d * sc and -dmin * m: exact there), then Q4_K's nibbles in Q4_1's order (byte j: weight j low, j + 16 high)
      or the 5-bit quants a byte each;
    - Q6_K (an fp16 d, an int8 scale per 16 weights): d, the block's two int8 scales, its 32 quants less 32.
    Why re-cut rather than read them as stored: the same tiles then serve every format, for 40, 24 or 36 bytes a
    block of 32 (the file's 22 to 26; 18 for Q4_K), against bf16's 64."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import Q4_K

    rows = blocks.shape[0]
    superblocks = blocks.reshape(-1, GGML_QUANT_SIZES[GGMLQuantizationType(qtype)][1])
    if qtype in (6, 7):  # blocks of 32: d (and Q5_1's m), the fifth bits, the nibbles
        d = superblocks[:, 0:2].copy().view(np.float16).astype(np.float32)
        minimum = superblocks[:, 2:4].copy().view(np.float16).astype(np.float32) if qtype == 7 else -16 * d
        rest = superblocks[:, 2 if qtype == 6 else 4:]
        high = (rest[:, :4].copy().view(np.uint32) >> np.arange(32, dtype=np.uint32)) & np.uint32(1)
        low = rest[:, 4:].reshape(-1, 1, 16) >> np.array([0, 4], dtype=np.uint8).reshape(1, 2, 1)
        q = (low & np.uint8(15)).reshape(-1, 32) | (high.astype(np.uint8) << np.uint8(4))
        head = np.concatenate([d, minimum], axis=-1).astype(np.float32).view(np.uint8)
        return np.ascontiguousarray(np.concatenate([head, q], axis=-1).reshape(rows, -1))
    if qtype == 14:
        ql = superblocks[:, :128].reshape(-1, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
        qh = superblocks[:, 128:192].reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)
        q = ((ql & np.uint8(15)).reshape(-1, 8, 32) | ((qh & np.uint8(3)).reshape(-1, 8, 32) << np.uint8(4)))
        body = (q.astype(np.int16) - 32).astype(np.int8).view(np.uint8)
        d = np.repeat(superblocks[:, 208:210][:, None, :], 8, axis=1)
        scales = superblocks[:, 192:208].reshape(-1, 8, 2)
        return np.ascontiguousarray(np.concatenate([d, scales, body], axis=-1).reshape(rows, -1))
    d = superblocks[:, 0:2].copy().view(np.float16).astype(np.float32)
    dmin = superblocks[:, 2:4].copy().view(np.float16).astype(np.float32)
    sc, m = Q4_K.get_scale_min(superblocks[:, 4:16])
    scale = d * sc.astype(np.float32)  # [superblocks, 8]
    minimum = -(dmin * m.astype(np.float32))
    qs = superblocks[:, -128:].reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    q = (qs & np.uint8(15)).reshape(-1, 8, 32)  # sub-block 2j: chunk j's low nibbles, 2j + 1: its high ones
    if qtype == 13:
        qh = superblocks[:, 16:48].reshape(-1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
        body = q | ((qh & np.uint8(1)) << np.uint8(4))
    else:
        body = q[:, :, :16] | (q[:, :, 16:] << np.uint8(4))
    head = np.stack([scale, minimum], axis=-1).astype(np.float32).view(np.uint8).reshape(-1, 8, 8)
    return np.ascontiguousarray(np.concatenate([head, body], axis=-1).reshape(rows, -1))


def _linears(model) -> dict[str, torch.nn.Module]:
    """{parameter name: module} of each decoder linear and the lm_head, by transformers' own names (before
    fusion.speed_up_linears fuses q/k/v and gate/up)."""
    wanted = {f"model.layers.{i}.{linear}": layer.get_submodule(linear)
              for i, layer in enumerate(model.model.layers) for linear in LINEARS}
    wanted["lm_head"] = model.lm_head
    return wanted


def from_gguf(path: str | Path, model, kernel) -> dict[str, PackedWeight]:
    """{parameter name: packed weight} for each decoder linear and the lm_head whose GGUF tensor is Q8_0, Q4_0,
    Q4_1 (or, where the kernels take them, Q5_0, Q5_1, Q4_K, Q5_K or Q6_K) and whose rows match the model's own weights, laid out
    for `kernel` (cpu.native.CpuKernels); everything else keeps the model's weights."""
    from gguf import GGML_QUANT_SIZES, MODEL_ARCH_NAMES, GGUFReader, get_tensor_name_map

    reader = GGUFReader(str(path))
    arch_field = reader.fields.get("general.architecture")
    arch_name = bytes(arch_field.parts[arch_field.data[0]]).decode() if arch_field else ""
    arch = next((key for key, value in MODEL_ARCH_NAMES.items() if value == arch_name), None)
    if arch is None:
        return {}
    names = get_tensor_name_map(arch, len(model.model.layers))
    tensors = {t.name: t for t in reader.tensors}
    config = model.config
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    packed = {}
    for module_name, module in _linears(model).items():
        candidates = [f"{names.get_name(module_name)}.weight"]
        if module_name == "lm_head":
            candidates.append("token_embd.weight")  # tied embeddings: the rows check below tells
        tensor = next((tensors[c] for c in candidates if c in tensors), None)
        weight = getattr(module, "weight", None)
        if tensor is None or weight is None or weight.dim() != 2:
            continue
        qtype = int(tensor.tensor_type)
        format = RECUT.get(qtype, qtype)
        if format not in BLOCK_BYTES:
            continue
        blocks = np.asarray(tensor.data)
        out_features, in_features = weight.shape
        weights_per_block, block_bytes = GGML_QUANT_SIZES[tensor.tensor_type]
        if in_features % weights_per_block or blocks.shape != (out_features, in_features // weights_per_block * block_bytes):
            continue
        orders = [np.arange(out_features)]
        if module_name.endswith(("q_proj", "k_proj")):
            orders.append(_llama_rows(out_features, heads if module_name.endswith("q_proj") else kv_heads))
        rows = next((order for order in orders if _matches(blocks, tensor.tensor_type, weight, order)), None)
        if rows is None:
            continue
        blocks = np.ascontiguousarray(blocks[rows])
        blocks = kernel.recut(blocks, qtype) if format != qtype else blocks
        try:
            data = kernel.pack(blocks, format, in_features)
        except ValueError:  # a format these kernels do not take (re-cut ones off the 512-bit VNNI path): bf16
            continue
        packed[module_name] = PackedWeight(data, format, out_features, in_features)
    return packed


def from_dense(model, kernel, format: int, checkpoint: Path | None = None, skip=(),
               head_format: int | None = None) -> dict[str, PackedWeight]:
    """{parameter name: packed weight} for each decoder linear and the lm_head (but those in `skip`), quantized
    to `format` blocks (the lm_head to `head_format`'s, if given) by gguf's own quantize, laid out for `kernel`
    as from_gguf's are.

    Quantized from the highest precision there is: the checkpoint's own safetensors files in `checkpoint` (a
    float32 file quantizes from float32, not from its bf16 rounding) where a tensor there is exactly what the
    model loaded once rounded to its dtype (a file that does not name it so, or holds other values, is not
    trusted), else from the loaded weights."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    packed = {}
    with ExitStack() as files:
        stored = _checkpoint_tensors(checkpoint, files)
        for name, module in _linears(model).items():
            weight = getattr(module, "weight", None)
            if name in skip or weight is None or weight.dim() != 2 or weight.shape[1] % 32:
                continue
            candidates = [f"{name}.weight"] + (["model.embed_tokens.weight"] if name == "lm_head" else [])
            full = next((t for t in (_stored(stored, c, weight) for c in candidates) if t is not None), None)
            full = weight.detach().float() if full is None else full
            to = (head_format or format) if name == "lm_head" else format
            blocks = np.ascontiguousarray(quantize(full.numpy(), GGMLQuantizationType(to)))
            out_features, in_features = weight.shape
            try:
                packed[name] = PackedWeight(kernel.pack(blocks, to, in_features), to, out_features, in_features)
            except ValueError:  # a shape the kernels do not take in blocks: it stays in the model's dtype
                continue
    return packed


def exact_tensors(model, checkpoint: Path | None) -> dict[str, torch.Tensor]:
    """{parameter name: float32 tensor} of the embedding and every RMSNorm weight the checkpoint's files hold
    in more precision than the model loaded them (a GGUF's conversion: its F32 norms and its embedding's
    dequantized values), for the packed decoder's fp32 activations, as llama.cpp reads them. Checked as
    from_dense's sources are: a tensor must round to what the model loaded."""
    norms = [name for name, module in model.named_modules() if name.endswith("norm") and hasattr(module, "weight")]
    wanted = {f"{name}.weight": model.get_submodule(name).weight for name in norms}
    wanted["model.embed_tokens.weight"] = model.model.embed_tokens.weight
    exact = {}
    with ExitStack() as files:
        stored = _checkpoint_tensors(checkpoint, files)
        for name, weight in wanted.items():
            tensor = _stored(stored, name, weight) if weight.dtype is not torch.float32 else None
            if tensor is not None and not torch.equal(tensor, weight.detach().float()):  # (else the model's are exact)
                exact[name] = tensor.contiguous()
    return exact


def _checkpoint_tensors(checkpoint: Path | None, files: ExitStack) -> dict:
    """{tensor name: the open safetensors file that holds it} over the checkpoint's files (not tuichat's own)."""
    from safetensors import SafetensorError, safe_open

    stored = {}
    for path in sorted(checkpoint.glob("*.safetensors")) if checkpoint is not None and checkpoint.is_dir() else ():
        if path.name.startswith("tuichat-"):
            continue
        try:
            file = files.enter_context(safe_open(str(path), "pt"))
        except (OSError, SafetensorError):  # unreadable: those weights come from the model instead
            continue
        for key in file.keys():
            stored.setdefault(key, file)
    return stored


def _stored(stored: dict, name: str, weight: torch.Tensor) -> torch.Tensor | None:
    """The checkpoint's `name` in float32 if, rounded to the model's dtype, it is `weight`; else None."""
    from safetensors import SafetensorError

    if name not in stored:
        return None
    try:
        tensor = stored[name].get_tensor(name)
    except (OSError, SafetensorError):
        return None
    if tensor.shape != weight.shape or not tensor.is_floating_point() or not torch.equal(tensor.to(weight.dtype), weight.detach()):
        return None
    return tensor.float()


def cache_name(mode: str) -> str:
    """The file that caches the packed weights of --quant `mode` (auto: a GGUF's own blocks)."""
    return "tuichat-packed.safetensors" if mode == "auto" else f"tuichat-packed-{mode}.safetensors"


def packed_weights(model, kernel, mode: str, gguf: str | Path | None = None, checkpoint: Path | None = None,
                   cache: Path | None = None) -> dict[str, PackedWeight]:
    """The weights --quant `mode` serves in blocks, remembered in `cache`: a GGUF's own blocks (`gguf`: the file;
    auto), and with int8 or int4 every other linear quantized (from_dense, from `checkpoint`'s files) — all of a
    dense checkpoint's, a GGUF's that the file does not hold in Q8_0/Q4_0/Q4_1 blocks. A GGUF's blocks are
    kept as they are, never quantized again: they are the file's own values, which requantizing would only
    move further from."""

    def pack() -> dict[str, PackedWeight]:
        packed = from_gguf(gguf, model, kernel) if gguf is not None else {}
        if mode in QUANT_FORMATS:
            linears, head = QUANT_FORMATS[mode]
            packed = {**from_dense(model, kernel, linears, checkpoint, packed, head), **packed}
        return packed

    # The formats are in the cache's tag: a cache of another choice (an older tuichat's) is never served as this.
    tag = f"{mode} {' '.join(NAMES[f] for f in QUANT_FORMATS[mode])}" if mode in QUANT_FORMATS else mode
    return _cached(cache, model, kernel, pack, tag)


def _cached(cache: Path | None, model, kernel, pack: Callable[[], dict[str, PackedWeight]],
            tag: str) -> dict[str, PackedWeight]:
    """pack(), remembered in `cache` (a safetensors file keyed by the weights' source: beside a GGUF's
    conversion, which is keyed by the file's content; for a dense checkpoint a folder keyed by its files):
    reading a GGUF's metadata alone takes seconds, quantizing a dense model more, the packed weights load in
    milliseconds. A cache of another version or `tag`, or whose tensors do not fit the model's shapes or the
    kernels' layout, or that does not read, is packed again and rewritten."""
    from safetensors import SafetensorError, safe_open
    from safetensors.torch import save_file

    if cache is not None and cache.is_file():
        try:
            with safe_open(str(cache), "pt") as file:
                meta = file.metadata() or {}
                # A cache without a tag is an older tuichat's, which cached only a GGUF's own blocks.
                if meta.get("version") == PACK_VERSION and meta.get("quant", "auto") == tag:
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
    packed = pack()
    if cache is not None and packed:
        meta = {name: f"{w.format},{w.out_features},{w.in_features},{kernel.layout(w.format, w.in_features)}"
                for name, w in packed.items()}
        temporary = cache.with_name(cache.name + f".tmp-{os.getpid()}")
        try:
            cache.parent.mkdir(parents=True, exist_ok=True)
            save_file({name: w.data for name, w in packed.items()}, str(temporary),
                      {"version": PACK_VERSION, "quant": tag, **meta})
            os.replace(temporary, cache)
        except OSError:  # a read-only cache: packing again next time is only slower
            if os.path.lexists(temporary):  # (False, not an error, where its folder could not be made)
                temporary.unlink(missing_ok=True)
    return packed
