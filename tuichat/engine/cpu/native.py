"""The library's Python side: every export's ctypes signature (CpuKernels) and the structs decoder_step reads
(LayerWeights, StepArgs), mirrored from csrc/kernels.h and checked against the library's own layout before
the first step (check_abi); and NativeDecoder, which runs steps of up to 512 rows (decodes, prefill chunks,
both mixed) of a llama-family model on a CPU through decoder.c: all decoder layers in one C call instead of
the many small torch ops of transformers' modules (docs/design/kernels.md). With weights packed in a GGUF's
blocks, every step runs there, its activations in fp32 and its KV cache in f16, as llama.cpp's.

transformers still computes the rotary cos/sin (so every RoPE variant it knows keeps working), kept per position
where its variant depends on nothing else; the embedding lookup, the layers and (with packed weights) the final
norm and the lm_head are one C call; in bf16 the final norm stays transformers' and the lm_head goes through
our linear after it. Longer steps, other architectures, other dtypes and devices keep the transformers path
of runner.py; both read and write the same paged cache.
"""

from __future__ import annotations

import ctypes

import numpy as np
import torch

from tuichat.engine import quant
from tuichat.engine.attention import ModelAttention
from tuichat.engine.families import ModelShape, text_config
from tuichat.engine.kv_cache import KVCache
from tuichat.engine.quant import PackedWeight
from tuichat.engine.runner import flatten

MAX_ROWS = 512  # the CPU token budget: every step of the default scheduler fits


class CpuKernels:
    """The built library: `isa` says which instructions its linear uses ("amx", "avx512", "avx2", ...);
    calling it runs the linear."""

    def __init__(self, library: ctypes.CDLL) -> None:
        self.library = library  # keeps the .so mapped; NativeDecoder finds decoder_step in it
        library.kernel_isa.restype = ctypes.c_char_p
        self.isa: str = library.kernel_isa().decode()
        self._fn = library.cpu_linear
        self._fn.restype = ctypes.c_int
        self._fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int] * 3 + [ctypes.c_long] * 2 + [ctypes.c_int]
        library.quant_math.restype = ctypes.c_char_p
        library.quant_math.argtypes = [ctypes.c_int, ctypes.c_int]
        library.pack_layout.restype = ctypes.c_char_p
        library.pack_layout.argtypes = [ctypes.c_int, ctypes.c_int]
        library.pack_blocks.restype = ctypes.c_int
        library.pack_blocks.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_void_p]
        library.recut_5bit.restype = ctypes.c_int
        library.recut_5bit.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_long, ctypes.c_void_p]
        self._draw = library.sample_row
        self._draw.restype = ctypes.c_int
        self._draw.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_int] + [ctypes.c_float] * 4 + [
            ctypes.c_int, ctypes.c_double]
        self._any = library.any_linear
        self._any.restype = ctypes.c_int
        self._any.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_int] + [ctypes.c_void_p] * 2 + [ctypes.c_int] * 3 + [
            ctypes.c_long] * 2 + [ctypes.c_int] * 2
        library.kernel_abi.restype = ctypes.c_char_p
        self.abi: str = library.kernel_abi().decode()  # decoder.c's structs, for check_abi
        library.kernels_trim.restype = ctypes.c_long
        library.kernels_scratch_bytes.restype = ctypes.c_long

    def trim(self) -> int:
        """Free the scratch memory no call holds (scratch.c); the bytes freed. The next call allocates again."""
        return self.library.kernels_trim()

    @property
    def scratch_bytes(self) -> int:
        """Bytes of scratch the library keeps for its next calls."""
        return self.library.kernels_scratch_bytes()

    @staticmethod
    def fits(weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
        """Whether a linear's parameters suit the kernel (checked once per layer, not per call)."""
        out_features, in_features = weight.shape
        return (
            weight.device.type == "cpu"
            and weight.dtype is torch.bfloat16
            and weight.is_contiguous()
            and in_features % 32 == 0
            and out_features % 16 == 0
            and (bias is None or (bias.dtype is torch.bfloat16 and bias.is_contiguous()))
        )

    def quant_math(self, format: int, in_features: int) -> str:
        """How the kernels compute a GGUF format: "int8 VNNI" and the like (inputs quantized per block of 32, as
        llama.cpp does) or "fp32" (the weights dequantized in registers, the inputs as they are)."""
        return self.library.quant_math(format, in_features).decode()

    def layout(self, format: int, in_features: int) -> str:
        """How pack() lays out `format` with `in_features` inputs: "tiles", "pairs" (or "signed pairs"), "rows", "in
        place" (read as the file holds them) or "none" (not taken)."""
        return self.library.pack_layout(format, in_features).decode()

    def pack(self, blocks, format: int, in_features: int, out: torch.Tensor | None = None) -> torch.Tensor:
        """GGUF blocks (a C-contiguous uint8 array [N, K / 32 * block bytes]) in the order the kernels read them,
        into `out` (uint8, blocks' shape) or a new tensor."""
        out = torch.empty(blocks.shape, dtype=torch.uint8) if out is None else out
        if self.library.pack_blocks(blocks.ctypes.data, format, blocks.shape[0], in_features, out.data_ptr()) != 0:
            raise ValueError(f"the CPU kernels do not take format {format} with {in_features} inputs")
        return out

    def recut(self, blocks, qtype: int):
        """quant.recut's output (a uint8 array [N, K / 32 * 40] for Q5_0/Q5_1), in C; quant.recut's own for the
        K-quants."""
        if qtype not in (6, 7):
            return quant.recut(blocks, qtype)
        blocks = np.ascontiguousarray(blocks)
        out = np.empty((blocks.shape[0], blocks.shape[1] // (22 if qtype == 6 else 24) * 40), dtype=np.uint8)
        if self.library.recut_5bit(blocks.ctypes.data, qtype, out.size // 40, out.ctypes.data) != 0:
            raise ValueError(f"recut_5bit does not take type {qtype}")
        return out

    def draw(self, row, params, u: float, reply: list[int] | None = None) -> int:
        """The token sampler.py's numpy path draws from `row` (a float32 numpy row of logits) with `params`
        and uniform `u`; `reply`: the reply's token ids so far, for params' penalties."""
        row = np.ascontiguousarray(row, dtype=np.float32)
        ids = np.asarray(reply if reply is not None else [], dtype=np.int64)
        token = self._draw(row.ctypes.data, row.shape[0], ids.ctypes.data, len(ids), params.frequency_penalty,
                           params.presence_penalty, params.temperature, params.top_p, params.top_k, u)
        if token < 0:
            raise MemoryError("sample_row could not allocate its scratch")
        return token

    def linear(self, x: torch.Tensor, weight, bias: torch.Tensor | None) -> torch.Tensor:
        """x [..., K] with at most MAX_ROWS rows times a quant.PackedWeight (bf16 or GGUF blocks): bf16 in, bf16
        out, or float32 in, float32 out (the quantized path's activations; see decoder.c)."""
        if x.dtype not in (torch.bfloat16, torch.float32):
            raise ValueError(f"the CPU linear takes bf16 or float32 inputs, not {x.dtype}")
        rows = x.reshape(-1, weight.in_features)
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        y = torch.empty(rows.shape[0], weight.out_features, dtype=x.dtype)
        status = self._any(
            rows.data_ptr(), weight.data.data_ptr(), weight.format, bias.data_ptr() if bias is not None else None,
            y.data_ptr(), rows.shape[0], weight.out_features, weight.in_features, rows.stride(0), weight.out_features,
            torch.get_num_threads(), int(x.dtype is torch.float32),
        )
        if status != 0:
            raise RuntimeError(f"any_linear failed ({status}) for {tuple(rows.shape)} x {weight.format}")
        return y.view(*x.shape[:-1], weight.out_features)

    def __call__(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [..., K] with at most MAX_ROWS rows, bf16; weight passed `fits`."""
        out_features, in_features = weight.shape
        rows = x.reshape(-1, in_features)
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        y = torch.empty(rows.shape[0], out_features, dtype=torch.bfloat16)
        status = self._fn(
            rows.data_ptr(), weight.data_ptr(), bias.data_ptr() if bias is not None else None, y.data_ptr(),
            rows.shape[0], out_features, in_features, rows.stride(0), out_features, torch.get_num_threads(),
        )
        if status != 0:
            raise RuntimeError(f"cpu_linear failed ({status}) for {tuple(rows.shape)} x {tuple(weight.shape)}")
        return y.view(*x.shape[:-1], out_features)


# Families whose decoder layer is exactly: RMSNorm, q/k/v (+bias) with RoPE, attention (full or in a sliding
# window), o_proj, residual, RMSNorm, SiLU-gated MLP, residual; and, in C with a GGUF's blocks only (the fp32
# steps), Qwen3 (each query and key head RMS-normed before RoPE) and Gemma 3 (those head norms, norms after the
# attention and the MLP, a GELU gate, scaled embeddings, local RoPE in its sliding-window layers).
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text")
_FP32_ONLY = ("qwen3", "gemma3_text")
_ACTIVATIONS = {"silu": 0, "gelu_pytorch_tanh": 1}  # decoder.c's step_args.act


def _activation(config) -> str:
    return getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", "silu")


def runs_in_c(family: str | None, gguf: bool) -> bool:
    """Whether decoder.c may run a model of this model_type (a GGUF is served from its file when it does)."""
    return family in SUPPORTED_MODEL_TYPES and (gguf or family not in _FP32_ONLY)


def family_reason(config, mapped: bool = False) -> str | None:
    """Why decoder.c can't run a model of this config's family (None: it may), before any weight is looked at.
    `mapped`: a GGUF served from its file (mapped.py), whose steps all run in fp32."""
    config = text_config(config)
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        return f"{config.model_type} layers are not implemented in C"
    if config.model_type in _FP32_ONLY and not mapped:
        return f"{config.model_type} layers run in C only over a GGUF served from its file"
    if _activation(config) not in (_ACTIVATIONS if mapped else ("silu",)):
        return f"activation {_activation(config)}"
    if getattr(config, "final_logit_softcapping", None):
        return "softcapped logits"
    return None


def _eps(norm) -> float:
    """An RMSNorm's epsilon, by either name transformers gives it."""
    return norm.variance_epsilon if hasattr(norm, "variance_epsilon") else norm.eps


def unsupported_reason(model, kernel: CpuKernels | None, attention: ModelAttention) -> str | None:
    """Why decoder.c can't run this model (None: it can). Expects speed_up_linears to have run; `attention` is
    what attention.inspect found."""
    if kernel is None:
        return "no CPU kernels"
    shape = ModelShape.of(model.config)
    if (why := family_reason(model.config, getattr(model, "tuichat_mapped", None) is not None)) is not None:
        return why
    if any(layer.softcap is not None for layer in attention.layers):
        return "softcapped attention"
    rotary_width = _rotary_width(model)
    if rotary_width != shape.head_dim:
        return f"rotary embedding over {rotary_width} of {shape.head_dim} head dims"
    if getattr(model, "hf_device_map", None) and len(set(model.hf_device_map.values())) > 1:
        return "layers split over devices"
    heads, kv_heads, head_dim = shape.heads, shape.kv_heads, shape.head_dim
    if head_dim % 32 or head_dim > (256 if getattr(model, "tuichat_mapped", None) is not None else 128) or heads % kv_heads or heads // kv_heads > 8:
        return f"head shape {heads}x{head_dim} over {kv_heads} KV heads"
    if shape.hidden % 32 or shape.intermediate % 32:
        return "hidden or intermediate size not a multiple of 32"
    for layer in model.model.layers if getattr(model, "tuichat_mapped", None) is None else ():  # (mapped: all packed)
        linears = [getattr(layer.self_attn, "fused_q_k_v", None), layer.self_attn.o_proj,
                   getattr(layer.mlp, "fused_gate_up", None), layer.mlp.down_proj]
        if any(l is None or not CpuKernels.fits(l.weight, l.bias) for l in linears):
            return "a linear our kernel does not take"
    return None


def _check(tensor: torch.Tensor, shape: tuple[int, ...], what: str, dtype: torch.dtype = torch.bfloat16) -> None:
    if tuple(tensor.shape) != shape or tensor.dtype is not dtype or not tensor.is_contiguous() or tensor.device.type != "cpu":
        raise ValueError(
            f"decoder.c needs {what} as a contiguous {'bf16' if dtype is torch.bfloat16 else dtype} CPU tensor of shape {shape}, got "
            f"{tuple(tensor.shape)} {tensor.dtype} on {tensor.device}{'' if tensor.is_contiguous() else ' (strided)'}"
        )


def _check_weight(weight: PackedWeight, shape: tuple[int, int], what: str) -> None:
    if (weight.out_features, weight.in_features) != shape:
        raise ValueError(f"decoder.c needs a {shape} weight in {what}, got {(weight.out_features, weight.in_features)}")
    if weight.format == quant.BF16:
        _check(weight.data, shape, what)
    elif (tuple(weight.data.shape) != (shape[0], quant.row_bytes(weight.format, shape[1]))
          or weight.data.dtype is not torch.uint8 or not weight.data.is_contiguous()):
        raise ValueError(f"decoder.c needs {quant.NAMES[weight.format]} blocks of a {shape} weight in {what}, got "
                         f"{tuple(weight.data.shape)} {weight.data.dtype}")


# decoder_step's failures (decoder.c).
_FAILURES = {-1: "a shape the kernels do not take", -2: "out of memory",
             -3: "a block table or position outside the cache", -4: "a token id or sampled row out of range",
             -5: "arguments laid out for another build of the kernels"}

_P, _I32, _F32 = ctypes.c_void_p, ctypes.c_int32, ctypes.c_float


class LayerWeights(ctypes.Structure):
    """decoder.c's layer_weights (kernels.h): one layer's weights, biases, norms and cache by address."""

    _fields_ = [(name, _P) for name in ("attn_norm", "qkv_w", "k_w", "v_w", "q_norm", "k_norm", "attn_post_norm",
                                        "mlp_post_norm", "qkv_b", "o_w", "o_b", "mlp_norm", "gate_up_w", "up_w",
                                        "gate_up_b", "down_w", "down_b", "k_cache", "v_cache")] + [
        (name, _I32) for name in ("qkv_fmt", "k_fmt", "v_fmt", "o_fmt", "gate_up_fmt", "up_fmt", "down_fmt", "window",
                                  "local_rope")]


class StepArgs(ctypes.Structure):
    """decoder.c's step_args (kernels.h): what decoder_step reads."""

    VERSION = 3  # kernels.h's STEP_ARGS_VERSION
    _fields_ = [("size", ctypes.c_uint32), ("version", ctypes.c_uint32)] + [
        (name, _P) for name in ("hidden", "ints", "tables", "embedding", "cos", "sin", "cos_local", "sin_local",
                                "sample_rows", "final_weight", "normed", "head", "head_bias", "logits", "layers")] + [
        (name, _I32) for name in ("f32", "rows", "tables_len", "num_blocks", "emb_f32", "vocab", "positions", "samples",
                                  "head_format", "vocab_out", "num_layers", "width", "heads", "kv_heads", "dim", "inter",
                                  "block_size", "threads", "act")] + [(name, _F32) for name in ("final_eps", "eps", "scale")]


def abi() -> str:
    """The two structs' layouts as decoder.c's kernel_abi() spells them."""
    def describe(name: str, struct) -> str:
        fields = " ".join(f"{field} {getattr(struct, field).offset}" for field, _ in struct._fields_)
        return f"{name} {ctypes.sizeof(struct)}: {fields}"
    return f"{describe('layer_weights', LayerWeights)}; {describe('step_args', StepArgs)}"


def check_abi(kernel: CpuKernels) -> None:
    """Refuse a library whose structs are not laid out as ours: every field would be read from the wrong place."""
    theirs = kernel.abi
    if theirs != abi():
        raise RuntimeError(f"decoder.c's structs differ from native.py's:\n  C:      {theirs}\n  Python: {abi()}")

# RoPE variants whose cos/sin at a position depend on that position alone ("dynamic" and "longrope" rescale with
# the longest position seen): their values can be computed once and looked up.
_STATIC_ROPE = ("default", "linear", "llama3", "yarn")


class RotaryTable:
    """cos/sin rows by position, computed by transformers' own rotary module and grown as positions arrive: a
    decode step's cos/sin through the module is a few torch ops on caches the weights just evicted (its cost:
    docs/design/kernels.md); a lookup is one gather. Variants outside _STATIC_ROPE go through the module every
    step."""

    GROW = 1024  # positions

    def __init__(self, rotary, dtype: torch.dtype, layer_type: str | None = None) -> None:
        """`layer_type`: for a module with RoPE per kind of layer (Gemma 3's), the kind's."""
        self.rotary, self.dtype = rotary, dtype
        self.kind = {} if layer_type is None else {"layer_type": layer_type}
        rope_type = getattr(rotary, "rope_type", None)
        self.static = (rope_type[layer_type] if isinstance(rope_type, dict) else rope_type) in _STATIC_ROPE
        self.cos = self.sin = torch.empty(0)

    def __call__(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin rows of these positions."""
        if not self.static:
            probe = torch.empty(0, dtype=self.dtype)
            return tuple(t[0].contiguous() for t in self.rotary(probe, positions[None], **self.kind))
        cos, sin = self.upto(int(positions.max()) + 1)
        return cos[positions], sin[positions]

    def upto(self, needed: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The tables, grown to hold at least `needed` positions (static variants only)."""
        if needed > self.cos.shape[0]:
            probe = torch.empty(0, dtype=self.dtype)
            every = torch.arange(-(-needed // self.GROW) * self.GROW)
            self.cos, self.sin = (t[0].contiguous() for t in self.rotary(probe, every[None], **self.kind))
        return self.cos, self.sin


def _layer_types(model) -> list[str] | None:
    """The layers' kinds where the rotary module has RoPE per kind (Gemma 3's), else None."""
    types = getattr(text_config(model.config), "layer_types", None)
    return list(types) if types and isinstance(getattr(model.model.rotary_emb, "rope_type", None), dict) else None


def _rotary_width(model) -> int:
    """How many dims transformers' rotary tables cover (a partial rotary factor makes it less than head_dim)."""
    probe = torch.zeros(1, 1, dtype=model.dtype)
    kinds = _layer_types(model)
    cos, _ = model.model.rotary_emb(probe, torch.zeros(1, 1, dtype=torch.long),
                                    **({"layer_type": kinds[0]} if kinds else {}))
    return cos.shape[-1]


class NativeDecoder:
    """`packed`: weights to serve as a GGUF file stores them (quant.from_gguf), by parameter name; the other
    linears are read in bf16. With any packed weight the decoder runs every step, splitting one longer than
    the kernels' 512 rows: transformers' layers then have no weights of their own to run. It then reads the
    embedding and the norms' weights in fp32: `exact`'s (quant.exact_tensors) where given, else the model's."""

    def __init__(self, model, kv: KVCache, block_size: int, kernel: CpuKernels,
                 packed: dict[str, PackedWeight] | None = None, exact: dict[str, torch.Tensor] | None = None,
                 embedding_rows=None, windows: list[int | None] | None = None) -> None:
        """`embedding_rows` (ids -> float32 rows): where the embedding's rows come from when the model holds no
        embedding matrix (a GGUF served from its map: mapped.py); the weights are then never joined, as joining
        would copy what is read in place. `windows`: each layer's sliding window (None: full attention), as
        attention.inspect found them."""
        self.model = model
        self.embedding_rows = embedding_rows
        self.block_size = block_size
        self.shape = ModelShape.of(model.config)
        self.kernel = kernel
        packed = packed or {}
        self.every_step = bool(packed)
        # Packed weights: fp32 activations over an f16 cache, as llama.cpp keeps them (see decoder.c).
        self.kv_dtype = torch.float16 if packed else torch.bfloat16
        exact = exact or {}

        def fp32(name: str, weight: torch.Tensor) -> torch.Tensor:
            return exact[name] if name in exact else weight.detach().float().contiguous()

        self.embedding = exact.get("model.embed_tokens.weight")  # else rows of the model's, widened
        self.final_norm = fp32("model.norm.weight", model.model.norm.weight) if packed else None
        rotary_dtype = torch.float32 if packed else torch.bfloat16
        kinds = _layer_types(model)  # RoPE per kind of layer: the full layers' table, the sliding ones' local one
        if kinds and not set(kinds) <= {"full_attention", "sliding_attention"}:
            raise ValueError(f"decoder.c has no RoPE for layers of kinds {sorted(set(kinds))}")
        self.rotary = RotaryTable(model.model.rotary_emb, rotary_dtype, "full_attention" if kinds else None)
        self.rotary_local = (RotaryTable(model.model.rotary_emb, rotary_dtype, "sliding_attention")
                             if kinds and "sliding_attention" in kinds else None)
        self.final_eps = _eps(model.model.norm)
        self._norms: list[torch.Tensor] = []  # the fp32 norm weights decoder.c reads by address
        layers = model.model.layers
        windows = windows or [None] * len(layers)
        self.eps = _eps(layers[0].input_layernorm)
        self.scale = layers[0].self_attn.scaling
        head = model.lm_head
        # The lm_head through our linear too where it fits (a row's logits then never depend on its batch).
        self.head = packed.get("lm_head") or (PackedWeight.of(head.weight) if CpuKernels.fits(head.weight, head.bias) else None)
        self.vocab = head.out_features  # the head's weight may have rows of padding after these (mapped.py)
        check_abi(kernel)
        self._fn = kernel.library.decoder_step
        self._fn.restype = ctypes.c_int
        self._fn.argtypes = [ctypes.POINTER(StepArgs)]
        self.num_blocks = kv.k[0].shape[0] // block_size
        if any(_eps(l.input_layernorm) != self.eps or _eps(l.post_attention_layernorm) != self.eps
               or l.self_attn.scaling != self.scale for l in layers):
            raise ValueError("decoder.c takes one norm epsilon and one attention scale for all layers")
        s = self.shape
        qkv, cache = (s.heads + 2 * s.kv_heads) * s.head_dim, (self.num_blocks * block_size, s.kv_heads, s.head_dim)
        self.weights: list[PackedWeight] = []  # what each step reads, in decoder.c's order (and the lm_head)
        table = (LayerWeights * len(layers))()

        def linear(i: int, names: list[str], sizes: list[int], width: int, bf16) -> list[PackedWeight]:
            """The linear as one weight (its parts' blocks joined, or the model's bf16), or, where its parts'
            blocks differ in format or some part has none, part by part: each part's blocks, else its rows of
            the bf16 weight. Each checked for the shape decoder.c assumes."""
            parts = [packed.get(f"model.layers.{i}.{name}") for name in names]
            joined = PackedWeight.cat(parts) if all(parts) and embedding_rows is None else None
            if joined is not None or not any(parts):
                weights, sizes = [joined or PackedWeight.of(bf16.weight)], [sum(sizes)]
            else:
                starts = [sum(sizes[:j]) for j in range(len(sizes))]
                weights = [part or PackedWeight.of(bf16.weight[a:a + n]) for part, a, n in zip(parts, starts, sizes)]
            for weight, rows in zip(weights, sizes):
                _check_weight(weight, (rows, width), f"layer {i}")
            return weights

        kv_rows = s.kv_heads * s.head_dim
        self._biases: list[torch.Tensor] = []  # joined q/k/v and gate/up biases of unfused linears, read by address
        for i, layer in enumerate(layers):  # each with the shape decoder.c assumes
            attn, mlp = layer.self_attn, layer.mlp
            qkv_parts = linear(i, ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
                               [s.heads * s.head_dim, kv_rows, kv_rows], s.hidden, getattr(attn, "fused_q_k_v", None))
            [o_w] = linear(i, ["self_attn.o_proj"], [s.hidden], s.heads * s.head_dim, attn.o_proj)
            gate_up_parts = linear(i, ["mlp.gate_proj", "mlp.up_proj"], [s.intermediate] * 2, s.hidden,
                                   getattr(mlp, "fused_gate_up", None))
            [down_w] = linear(i, ["mlp.down_proj"], [s.hidden], s.intermediate, mlp.down_proj)
            qkv_b = self._joined_bias(attn, "fused_q_k_v", ("q_proj", "k_proj", "v_proj"))
            gate_up_b = self._joined_bias(mlp, "fused_gate_up", ("gate_proj", "up_proj"))
            weights = [*qkv_parts, o_w, *gate_up_parts, down_w]
            qkv_w, gate_up_w = qkv_parts[0], gate_up_parts[0]
            # Gemma 3 norms the MLP's input with pre_feedforward_layernorm, and its post_attention_layernorm and
            # post_feedforward_layernorm the two sublayers' outputs.
            sandwich = hasattr(layer, "pre_feedforward_layernorm")
            names = ("input_layernorm", "pre_feedforward_layernorm" if sandwich else "post_attention_layernorm")
            norms = [getattr(layer, name).weight for name in names]
            if packed:
                norms = [fp32(f"model.layers.{i}.{n}.weight", w) for n, w in zip(names, norms)]
                self._norms += norms
            norm_dtype = torch.float32 if packed else torch.bfloat16
            extra_norms = {}  # fp32 only: Qwen3's and Gemma 3's q_norm and k_norm (over a head's dim), Gemma 3's post norms
            for name, hf_name, width in [("q_norm", "self_attn.q_norm", s.head_dim), ("k_norm", "self_attn.k_norm", s.head_dim),
                                         ("attn_post_norm", "post_attention_layernorm", s.hidden),
                                         ("mlp_post_norm", "post_feedforward_layernorm", s.hidden)]:
                if name == "attn_post_norm" and not sandwich:  # a llama's: the MLP's input norm, above
                    continue
                try:
                    module = layer.get_submodule(hf_name)
                except AttributeError:  # a family without it
                    continue
                if not packed:
                    raise ValueError(f"decoder.c runs {name} only over a GGUF's blocks (its fp32 steps)")
                if _eps(module) != self.eps:
                    raise ValueError("decoder.c takes one norm epsilon for all norms")
                extra_norms[name] = fp32(f"model.layers.{i}.{hf_name}.weight", module.weight)
                _check(extra_norms[name], (width,), f"layer {i}", torch.float32)
                self._norms.append(extra_norms[name])
            for tensor, shape, dtype in [
                (norms[0], (s.hidden,), norm_dtype), (qkv_b, (qkv,), torch.bfloat16),
                (attn.o_proj.bias, (s.hidden,), torch.bfloat16), (norms[1], (s.hidden,), norm_dtype),
                (gate_up_b, (2 * s.intermediate,), torch.bfloat16),
                (mlp.down_proj.bias, (s.hidden,), torch.bfloat16), (kv.k[i], cache, self.kv_dtype),
                (kv.v[i], cache, self.kv_dtype),
            ]:
                if tensor is not None:
                    _check(tensor, shape, f"layer {i}", dtype)
            k_w, v_w = qkv_parts[1:] or (None, None)
            linears = {"qkv_w": qkv_w, "k_w": k_w, "v_w": v_w, "o_w": o_w, "gate_up_w": gate_up_w,
                       "up_w": gate_up_parts[1] if len(gate_up_parts) > 1 else None, "down_w": down_w}
            tensors = {"attn_norm": norms[0], "mlp_norm": norms[1], "qkv_b": qkv_b,
                       "o_b": attn.o_proj.bias, "gate_up_b": gate_up_b, "down_b": mlp.down_proj.bias,
                       "k_cache": kv.k[i], "v_cache": kv.v[i], **extra_norms}
            local = kinds is not None and kinds[i] == "sliding_attention"
            table[i] = LayerWeights(  # fields left out (a bias, a part) stay NULL
                window=windows[i] or 0, local_rope=int(local),
                **{name: w.data.data_ptr() for name, w in linears.items() if w is not None},
                **{name.removesuffix("_w") + "_fmt": w.format for name, w in linears.items() if w is not None},
                **{name: t.data_ptr() for name, t in tensors.items() if t is not None})
            self.weights += weights
        if self.head is not None:
            self.weights.append(self.head)
        # The parameters and the cache never move after this, so their addresses are taken once; a step sets only
        # what changes from step to step.
        self._table = table
        bias = model.lm_head.bias
        self._args = StepArgs(
            size=ctypes.sizeof(StepArgs), version=StepArgs.VERSION, layers=ctypes.addressof(table),
            num_layers=len(layers), width=s.hidden, heads=s.heads, kv_heads=s.kv_heads, dim=s.head_dim,
            inter=s.intermediate, block_size=block_size, eps=self.eps, scale=self.scale, f32=int(self.every_step),
            num_blocks=self.num_blocks, final_eps=self.final_eps, act=_ACTIVATIONS[_activation(text_config(model.config))],
            final_weight=self.final_norm.data_ptr() if self.final_norm is not None else None)
        self._head = (None, 0, None, 0) if self.head is None else (
            self.head.data.data_ptr(), self.head.format, None if bias is None else bias.data_ptr(), self.head.out_features)
        self._checked_embedding = None

    def _joined_bias(self, part, fused: str, names: tuple[str, ...]) -> torch.Tensor | None:
        """The bias of `part`'s fused linear, or its linears' biases joined (zeros for one without), or None."""
        if hasattr(part, fused):
            return getattr(part, fused).bias
        linears = [getattr(part, name) for name in names]
        if all(l.bias is None for l in linears):
            return None
        joined = torch.cat([l.bias.detach() if l.bias is not None else torch.zeros(l.out_features, dtype=torch.bfloat16)
                            for l in linears]).to(torch.bfloat16).contiguous()
        self._biases.append(joined)
        return joined

    @property
    def formats(self) -> str:
        """The weight formats a step reads, e.g. "Q4_1, Q8_0" or "bfloat16"."""
        return ", ".join(sorted({quant.NAMES[w.format] for w in self.weights}))

    @property
    def weight_bytes(self) -> int:
        """Bytes of linear weights a decode step reads."""
        return sum(w.bytes for w in self.weights)

    def accepts(self, num_rows: int) -> bool:
        return num_rows >= 1 and (self.every_step or num_rows <= MAX_ROWS)

    def lm_head(self, x: torch.Tensor) -> torch.Tensor:
        if self.head is None:
            return self.model.lm_head(x.to(self.model.lm_head.weight.dtype))
        return self.kernel.linear(x, self.head, self.model.lm_head.bias)[..., :self.vocab]

    @torch.inference_mode()
    def execute(self, chunks) -> torch.Tensor | None:
        """Same contract as ModelRunner.execute: float32 logits of the sampling chunks, in order, or None. The
        step (with packed weights, up to the logits) is one decoder_step call, fed one int32 tensor: ids,
        positions, where each row's block table starts, the rows that sample, then the tables."""
        tokens, positions, sample_rows = flatten(chunks)
        rows = None
        if self.embedding_rows is not None:  # the step's own rows of the embedding, looked up by their index
            distinct, tokens = np.unique(np.asarray(tokens), return_inverse=True)
            rows, tokens = self.embedding_rows(distinct), tokens.tolist()
        table_offsets: list[int] = []  # per row: where its sequence's block table starts in `tables`
        tables: list[int] = []
        for chunk in chunks:
            table_offsets += [len(tables)] * len(chunk.token_ids)
            tables += chunk.block_table
        n, shape, samples = len(tokens), self.shape, len(sample_rows)
        ints = torch.tensor(tokens + positions + table_offsets + sample_rows + tables, dtype=torch.int32)
        base = ints.data_ptr()
        tables_of = [self.rotary] + ([self.rotary_local] if self.rotary_local is not None else [])
        if all(table.static for table in tables_of):  # tables by position: decoder.c looks each row's up
            rope = [table.upto(max(positions) + 1) for table in tables_of]
            by_position = rope[0][0].shape[0]
        else:
            rope = [table(torch.tensor(positions)) for table in tables_of]
            by_position = 0
        # decoder.c reads these by pointer, trusting their shapes: a mismatch must stop here, not read past them.
        dtype = torch.float32 if self.every_step else torch.bfloat16
        for cos, sin in rope:
            _check(cos, (by_position or n, shape.head_dim), "rotary cos", dtype)
            _check(sin, (by_position or n, shape.head_dim), "rotary sin", dtype)
        (cos, sin), (cos_local, sin_local) = rope[0], rope[-1]
        embedding = self.model.model.embed_tokens.weight if self.embedding is None else self.embedding
        embedding = rows if rows is not None else embedding
        if embedding is not self._checked_embedding:  # it never changes in a model's life: checked once
            _check(embedding, (embedding.shape[0], shape.hidden), "the embedding", embedding.dtype)
            if embedding.dtype not in (torch.bfloat16, dtype):
                raise ValueError(f"decoder.c reads the embedding in bf16{' or float32' if self.every_step else ''}, not {embedding.dtype}")
            self._checked_embedding = embedding
        hidden = torch.empty(n, shape.hidden, dtype=dtype)  # decoder.c writes every row
        # With packed weights the final norm and the lm_head run in the same call (fp32 logits straight out).
        fused = self.final_norm is not None and samples > 0
        last = torch.empty(samples, shape.hidden) if fused else None
        head, head_format, head_bias, vocab_out = self._head if fused else (None, 0, None, 0)
        logits = torch.empty(samples, vocab_out) if head is not None else None
        a = self._args
        a.hidden, a.ints, a.rows, a.tables, a.tables_len = hidden.data_ptr(), base, n, base + 4 * (3 * n + samples), len(tables)
        a.embedding, a.emb_f32, a.vocab = embedding.data_ptr(), int(embedding.dtype is torch.float32), embedding.shape[0]
        a.cos, a.sin, a.positions = cos.data_ptr(), sin.data_ptr(), by_position
        a.cos_local, a.sin_local = (cos_local.data_ptr(), sin_local.data_ptr()) if len(rope) > 1 else (None, None)
        a.sample_rows, a.samples, a.normed = base + 4 * 3 * n, samples, last.data_ptr() if fused else None
        a.head, a.head_format, a.head_bias, a.vocab_out = head, head_format, head_bias, vocab_out
        a.logits, a.threads = logits.data_ptr() if logits is not None else None, torch.get_num_threads()
        status = self._fn(a)
        if status != 0:
            raise RuntimeError(f"decoder_step failed for {n} rows: {_FAILURES.get(status, status)}")
        if not sample_rows:
            return None
        if logits is not None:
            return logits if logits.shape[1] == self.vocab else logits[:, :self.vocab]
        if last is None:
            last = self.model.model.norm(hidden[sample_rows])
        return self.lm_head(last).float()
