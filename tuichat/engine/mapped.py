"""A GGUF model served from the file itself: no bf16 copy in memory, no converted copy on disk.

transformers' model class gives the structure (built on the meta device: no weight is allocated), the file's
metadata the config and tokenizer (gguf_file.py). Each linear becomes a PackedLinear over the file's blocks:
Q4_K and Q6_K as views of the file's map, read in place by the kernels; Q8_0, Q4_0, Q4_1, Q5_0 and Q5_1 laid
out in the kernels' tiles (the 5-bit ones re-cut into blocks of 32 where the tiled path is not built), Q5_K
re-cut (the size of the file's tensors or, re-cut, larger); F16, BF16 and F32 in bf16. Both the map and the
copies ask for 2 MB pages (GGUFFile, heap.WeightArena). The file's pages of a copied tensor are released once it
is copied (GGUFFile.release), so that the process does not hold both. The embedding's rows are dequantized when
a step looks them up, the norms are the file's F32 values.
The decoder (decoder.c) runs every step over these; transformers' layers, over the same PackedLinears, run only
the load's probe, against which the serving path is checked.

llama.cpp's converter permutes the rows of a llama's Q and K (rotary pairs interleaved); those two tensors are
copied back into transformers' order (a fifth of a layer's attention bytes), so that one rotary code serves
both kinds of model.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import nn

from tuichat.engine import quant
from tuichat.engine.gguf_file import GGUFFile, config_and_tokenizer
from tuichat.engine.heap import WeightArena
from tuichat.engine.quant import PackedWeight
from tuichat.engine.types import TuichatError

# GGUF architectures whose layers decoder.c runs (native.SUPPORTED_MODEL_TYPES), by the model_type they load as.
ARCHITECTURES = {"llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3", "gemma3": "gemma3_text"}
_PERMUTED_QK = ("llama", "mistral")  # convert_hf_to_gguf interleaves these architectures' Q and K rows
# Gemma's RMSNorm scales by 1 + weight; convert_hf_to_gguf stores weight + 1, which transformers' norm gets back.
_SHIFTED_NORMS = ("gemma3",)


class PackedLinear(nn.Module):
    """A linear over a quant.PackedWeight, through the CPU kernels (bf16 or fp32 in, the same out); its first
    `out_features` outputs where the weight has rows of padding."""

    def __init__(self, weight: PackedWeight, bias: torch.Tensor | None, kernel, out_features: int | None = None) -> None:
        super().__init__()
        self.packed, self.kernel = weight, kernel
        self.in_features, self.out_features = weight.in_features, out_features or weight.out_features
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.kernel.linear(x, self.packed, self.bias)
        return y if self.out_features == self.packed.out_features else y[..., :self.out_features]


class MappedEmbedding(nn.Module):
    """token_embd's rows, dequantized (gguf's own dequantize, float32) only for the ids a step looks up, times
    `scale` (Gemma's square root of the hidden size, in float32 as llama.cpp scales them)."""

    def __init__(self, blocks: np.ndarray, qtype: int, vocab: int, hidden: int, dtype: torch.dtype,
                 scale: float = 1.0) -> None:
        super().__init__()
        self.blocks, self.qtype, self.dtype, self.scale = blocks, qtype, dtype, np.float32(scale)
        self.num_embeddings, self.embedding_dim = vocab, hidden
        # What callers read of an embedding's weight: its device and dtype (none of its values).
        self.register_buffer("weight", torch.empty(0, dtype=dtype), persistent=False)

    def rows(self, ids) -> torch.Tensor:
        """float32 [len(ids), hidden]."""
        values = _float32(self.blocks[np.asarray(ids, dtype=np.int64)], self.qtype)
        if self.scale != 1:
            values = values * self.scale
        return torch.from_numpy(np.ascontiguousarray(values).reshape(len(ids), self.embedding_dim))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1).cpu().numpy()
        return self.rows(flat).to(self.dtype).view(*ids.shape, self.embedding_dim)


@dataclass
class Mapped:
    """What a mapped model serves with: the linears' packed weights and the fp32 norms by transformers'
    parameter names (prepare hands them to native.NativeDecoder), the embedding, and the open file."""

    file: GGUFFile
    packed: dict[str, PackedWeight] = field(default_factory=dict)
    exact: dict[str, torch.Tensor] = field(default_factory=dict)
    embedding: MappedEmbedding | None = None
    in_place_bytes: int = 0  # of the linears read from the map (the rest are copies in memory)
    huge_page_bytes: int = 0  # of the file, what this process maps in 2 MB pages once loaded (GGUFFile.settle_pages)


def gguf_model_type(path: str | Path) -> str | None:
    """The model_type a GGUF loads as when its layers run in C here, else None (it goes the converted way)."""
    file = GGUFFile(path)
    try:
        arch = file.architecture
        if arch == "llama" and "mistral" in str(file.fields.get("general.name", "")).lower():
            return "mistral"  # transformers' own rule for llama.cpp's shared architecture name
        return ARCHITECTURES.get(arch)
    finally:
        file.close()


def _to_bf16(values: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).to(torch.bfloat16)


def _float32(stored: np.ndarray, qtype: int) -> np.ndarray:
    """Values as GGUFFile.array gives them (blocks, or F32/F16/BF16 values) in float32: gguf's own dequantize."""
    from gguf.quants import dequantize

    if qtype == 30:  # BF16, as raw bits
        return (stored.astype(np.uint32) << 16).view(np.float32)
    return stored.astype(np.float32) if qtype in (0, 1) else dequantize(stored, qtype)


def _dequantized(file: GGUFFile, name: str) -> np.ndarray:
    return _float32(file.array(name), file.tensors[name].type)


# The kernels take weights of a multiple of this many rows; an lm_head of another vocabulary size (32001 rows:
# a llama with a pad token added) gets rows of zeros, whose logits are cut off.
ROW_MULTIPLE = 16


def packed_weight(file: GGUFFile, name: str, kernel, rows: np.ndarray | None, arena: WeightArena) -> PackedWeight:
    """Tensor `name` as the kernels will read it (see the module's docstring), its rows reordered by `rows`, and
    padded with zeros to a multiple of ROW_MULTIPLE. Copies are made in `arena`."""
    info = file.tensors[name]
    (file_rows, in_features), qtype = info.shape, info.type
    out_features = file_rows + -file_rows % ROW_MULTIPLE
    in_place = qtype in quant.IN_PLACE and kernel.layout(qtype, in_features) == "in place"
    blocks = file.array(name)
    copied = rows is not None or out_features > file_rows
    if copied:  # reordered or padded, in one copy: in the arena where the kernels read it as it is
        shape = (out_features, *blocks.shape[1:])
        copy = arena.array(shape, blocks.dtype) if in_place else np.empty(shape, blocks.dtype)
        if rows is None:
            copy[:file_rows] = blocks
        else:
            np.take(blocks, rows, axis=0, out=copy[:file_rows])
        copy[file_rows:] = 0  # zero bytes are zero weights in every format (their scales are 0)
        blocks = copy
    if in_place:
        if copied:
            file.release(name)  # served from the copy
        with warnings.catch_warnings():  # a read-only map: torch warns that writes would fail; none are made
            warnings.simplefilter("ignore", UserWarning)
            data = torch.from_numpy(blocks)
        return PackedWeight(data, qtype, out_features, in_features)
    for format in ([qtype] if qtype in quant.BLOCK_BYTES else []) + ([quant.RECUT[qtype]] if qtype in quant.RECUT else []):
        try:
            source = np.ascontiguousarray(blocks) if format == qtype else kernel.recut(blocks, qtype)
            out = torch.from_numpy(arena.array(source.shape))
            packed = PackedWeight(kernel.pack(source, format, in_features, out), format, out_features, in_features)
            break
        except ValueError:  # a layout these kernels do not take: the next, or bf16
            continue
    else:  # bf16 in the arena too: a step streams it as it does the blocks
        values = _to_bf16(_float32(blocks, qtype)).view(torch.int16).numpy()
        packed = PackedWeight.of(torch.from_numpy(arena.copy(values)).view(torch.bfloat16))
    file.release(name)  # served from the copy: the file's bytes need not stay resident beside it
    return packed


def _exact(file: GGUFFile, name: str) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(_dequantized(file, name), dtype=np.float32))


def load(path: str | Path, kernel, cache: Path | None, with_tokenizer: bool = True):
    """(model, tokenizer or None): the model in bf16 on the CPU over `path`'s own blocks, its `tuichat_mapped`
    attribute a Mapped. Raises TuichatError for a file it cannot serve so."""
    from accelerate import init_empty_weights
    from gguf import MODEL_ARCH_NAMES, get_tensor_name_map
    from transformers import AutoModelForCausalLM

    file = GGUFFile(path)
    try:
        config, tokenizer = config_and_tokenizer(file, cache, with_tokenizer)
        with init_empty_weights(include_buffers=False):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        arch = next((key for key, value in MODEL_ARCH_NAMES.items() if value == file.architecture), None)
        layers = model.model.layers
        names = get_tensor_name_map(arch, len(layers))
        mapped = Mapped(file)
        arena = WeightArena()

        def tensor(hf_name: str, suffix: str = "weight") -> str | None:
            name = f"{names.get_name(hf_name)}.{suffix}" if names.get_name(hf_name) else None
            return name if name in file.tensors else None

        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        permuted = file.architecture in _PERMUTED_QK
        in_place: list[str] = []
        for module_name in quant._linears(model):
            gguf_name = tensor(module_name)
            if module_name == "lm_head" and gguf_name is None:
                gguf_name = "token_embd.weight"  # tied
            if gguf_name is None:
                raise TuichatError(f"{file.path.name} has no tensor for {module_name}")
            rows = None
            if permuted and module_name.endswith(("q_proj", "k_proj")):
                rows = quant._llama_rows(file.tensors[gguf_name].shape[0], heads if module_name.endswith("q_proj") else kv_heads)
            weight = packed_weight(file, gguf_name, kernel, rows, arena)
            bias_name = tensor(module_name, "bias")
            bias = None
            if bias_name is not None:
                values = _dequantized(file, bias_name)
                bias = _to_bf16(values if rows is None else values[rows])
                bias = torch.cat([bias, bias.new_zeros(weight.out_features - len(bias))])  # padded as the weight
            parent, _, leaf = module_name.rpartition(".")
            linear = PackedLinear(weight, bias, kernel, file.tensors[gguf_name].shape[0])
            (model.get_submodule(parent) if parent else model).add_module(leaf, linear)
            mapped.packed[module_name] = weight
            if weight.format in quant.IN_PLACE and rows is None:
                mapped.in_place_bytes += weight.bytes
                in_place.append(gguf_name)
        for module_name, module in model.named_modules():
            if module_name.endswith("norm") and hasattr(module, "weight"):
                gguf_name = tensor(module_name)
                if gguf_name is None:
                    raise TuichatError(f"{file.path.name} has no tensor for {module_name}")
                exact = _exact(file, gguf_name)
                shift = 1.0 if file.architecture in _SHIFTED_NORMS else 0.0
                module.weight = nn.Parameter((exact - shift).to(torch.bfloat16), requires_grad=False)
                mapped.exact[f"{module_name}.weight"] = exact
        info = file.tensors["token_embd.weight"]
        # float32 out: the probe's forward then keeps fp32 activations, as decoder.c does (bf16 ones drift a few %
        # of the logit range from it over a model's depth, which the serving-path check would take for a fault).
        mapped.embedding = MappedEmbedding(file.array("token_embd.weight"), info.type, info.shape[0], info.shape[1],
                                           torch.float32, getattr(model.model.embed_tokens, "scalar_embed_scale", 1.0))
        model.model.embed_tokens = mapped.embedding
        if "rope_freqs.weight" in file.tensors:  # Llama 3's RoPE scaling, as llama.cpp applies it: per-pair divisors
            rotary = model.model.rotary_emb
            factors = torch.from_numpy(_dequantized(file, "rope_freqs.weight").astype(np.float32))
            rotary.inv_freq = rotary.inv_freq / factors.to(rotary.inv_freq.device)
            rotary.original_inv_freq = rotary.inv_freq
        left = [name for name, p in [*model.named_parameters(), *model.named_buffers()] if p.is_meta]
        if left:  # a tensor this family has that the mapping above does not know
            raise TuichatError(f"tuichat cannot serve {file.path.name} from the file: nothing fills {', '.join(left[:4])}")
        mapped.huge_page_bytes = file.settle_pages(in_place)
        model.tuichat_mapped = mapped
        model.eval()
        return model, tokenizer
    except BaseException:
        file.close()
        raise
