"""Steps of up to 512 rows (decodes, prefill chunks, both mixed) of a llama-family model in bf16 on a CPU run
through decoder.c: all decoder layers in one C call instead of ~1,600 torch ops.

transformers still does what is one op per step anyway: the embedding lookup, the rotary cos/sin (so every
RoPE variant it knows keeps working) and the final norm; the lm_head goes through our linear. Longer steps,
other architectures, other dtypes and devices keep the transformers path of runner.py; both read and write
the same paged cache.
"""

from __future__ import annotations

import ctypes

import torch

from tuichat.engine.cpu_kernel import MAX_ROWS, CpuKernels
from tuichat.engine.attention import ModelAttention
from tuichat.engine.kv_cache import KVCache, ModelShape
from tuichat.engine.runner import flatten

# Families whose decoder layer is exactly: RMSNorm, q/k/v (+bias) with RoPE, full attention, o_proj, residual,
# RMSNorm, SiLU-gated MLP, residual. Qwen3 (q/k norms) or Gemma (scaled embeddings, other norms) are not.
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")


def unsupported_reason(model, kernel: CpuKernels | None, attention: ModelAttention) -> str | None:
    """Why decoder.c can't run this model (None: it can). Expects speed_up_linears to have run; `attention` is
    what attention.inspect found."""
    if kernel is None:
        return "no CPU kernels"
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    shape = ModelShape.of(config)
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        return f"{config.model_type} layers are not implemented in C"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"activation {config.hidden_act}"
    if any(layer.window is not None for layer in attention.layers):
        return "sliding-window layers"
    if any(layer.softcap is not None for layer in attention.layers):
        return "softcapped attention"
    rotary_width = _rotary_width(model)
    if rotary_width != shape.head_dim:
        return f"rotary embedding over {rotary_width} of {shape.head_dim} head dims"
    if getattr(model, "hf_device_map", None) and len(set(model.hf_device_map.values())) > 1:
        return "layers split over devices"
    heads, kv_heads, head_dim = shape.heads, shape.kv_heads, shape.head_dim
    if head_dim % 32 or head_dim > 128 or heads % kv_heads or heads // kv_heads > 8:
        return f"head shape {heads}x{head_dim} over {kv_heads} KV heads"
    if shape.hidden % 32 or shape.intermediate % 32:
        return "hidden or intermediate size not a multiple of 32"
    for layer in model.model.layers:
        linears = [getattr(layer.self_attn, "fused_q_k_v", None), layer.self_attn.o_proj,
                   getattr(layer.mlp, "fused_gate_up", None), layer.mlp.down_proj]
        if any(l is None or not CpuKernels.fits(l.weight, l.bias) for l in linears):
            return "a linear our kernel does not take"
    return None


def _check(tensor: torch.Tensor, shape: tuple[int, ...], what: str) -> None:
    if tuple(tensor.shape) != shape or tensor.dtype is not torch.bfloat16 or not tensor.is_contiguous() or tensor.device.type != "cpu":
        raise ValueError(
            f"decoder.c needs {what} as a contiguous bf16 CPU tensor of shape {shape}, got "
            f"{tuple(tensor.shape)} {tensor.dtype} on {tensor.device}{'' if tensor.is_contiguous() else ' (strided)'}"
        )


def _rotary_width(model) -> int:
    """How many dims transformers' rotary tables cover (a partial rotary factor makes it less than head_dim)."""
    probe = torch.zeros(1, 1, dtype=model.dtype)
    cos, _ = model.model.rotary_emb(probe, torch.zeros(1, 1, dtype=torch.long))
    return cos.shape[-1]


class NativeDecoder:
    def __init__(self, model, kv: KVCache, block_size: int, kernel: CpuKernels) -> None:
        self.model = model
        self.block_size = block_size
        self.shape = ModelShape.of(model.config)
        layers = model.model.layers
        self.eps = layers[0].input_layernorm.variance_epsilon
        self.scale = layers[0].self_attn.scaling
        head = model.lm_head
        # The lm_head through our linear too where it fits (a row's logits then never depend on its batch).
        self.lm_head = (lambda x: kernel(x, head.weight, head.bias)) if CpuKernels.fits(head.weight, head.bias) else head
        self._fn = kernel.library.decoder_forward
        self._fn.restype = ctypes.c_int
        self._fn.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int] * 3 + [ctypes.c_void_p] + [ctypes.c_int] * 7 + [
            ctypes.c_float, ctypes.c_float, ctypes.c_int]
        self.num_blocks = kv.k[0].shape[0] // block_size

        def address(tensor: torch.Tensor | None) -> int:
            return 0 if tensor is None else tensor.data_ptr()

        if any(l.input_layernorm.variance_epsilon != self.eps or l.post_attention_layernorm.variance_epsilon != self.eps
               or l.self_attn.scaling != self.scale for l in layers):
            raise ValueError("decoder.c takes one norm epsilon and one attention scale for all layers")
        s = self.shape
        qkv, cache = (s.heads + 2 * s.kv_heads) * s.head_dim, (self.num_blocks * block_size, s.kv_heads, s.head_dim)
        addresses = []
        for i, layer in enumerate(layers):  # the order of decoder.c's enum, each with the shape decoder.c assumes
            attn, mlp = layer.self_attn, layer.mlp
            expected = [
                (layer.input_layernorm.weight, (s.hidden,)), (attn.fused_q_k_v.weight, (qkv, s.hidden)),
                (attn.fused_q_k_v.bias, (qkv,)), (attn.o_proj.weight, (s.hidden, s.heads * s.head_dim)),
                (attn.o_proj.bias, (s.hidden,)), (layer.post_attention_layernorm.weight, (s.hidden,)),
                (mlp.fused_gate_up.weight, (2 * s.intermediate, s.hidden)), (mlp.fused_gate_up.bias, (2 * s.intermediate,)),
                (mlp.down_proj.weight, (s.hidden, s.intermediate)), (mlp.down_proj.bias, (s.hidden,)),
                (kv.k[i], cache), (kv.v[i], cache),
            ]
            for tensor, shape in expected:
                if tensor is not None:
                    _check(tensor, shape, f"layer {i}")
            addresses += [tensor for tensor, _ in expected]
        # The parameters and the cache never move after this, so their addresses are taken once.
        self._layers = torch.tensor([address(t) for t in addresses], dtype=torch.uint64)

    @staticmethod
    def accepts(num_rows: int) -> bool:
        return 1 <= num_rows <= MAX_ROWS

    @torch.inference_mode()
    def execute(self, chunks) -> torch.Tensor | None:
        """Same contract as ModelRunner.execute: float32 logits of the sampling chunks, in order, or None."""
        tokens, positions, sample_rows = flatten(chunks)
        table_offsets: list[int] = []  # per row: where its sequence's block table starts in `tables`
        tables: list[int] = []
        for chunk in chunks:
            table_offsets += [len(tables)] * len(chunk.token_ids)
            tables += chunk.block_table
        model = self.model.model
        hidden = model.embed_tokens(torch.tensor(tokens))  # a fresh tensor: decoder.c updates it in place
        position_ids = torch.tensor(positions)
        cos, sin = (t[0].contiguous() for t in model.rotary_emb(hidden, position_ids[None]))
        position_ids = position_ids.int()
        table_offsets_t = torch.tensor(table_offsets, dtype=torch.int32)
        tables_t = torch.tensor(tables, dtype=torch.int32)
        shape = self.shape
        # decoder.c reads these by pointer, trusting their shapes: a mismatch must stop here, not read past them.
        _check(hidden, (len(tokens), shape.hidden), "hidden states")
        _check(cos, (len(tokens), shape.head_dim), "rotary cos")
        _check(sin, (len(tokens), shape.head_dim), "rotary sin")
        status = self._fn(
            hidden.data_ptr(), cos.data_ptr(), sin.data_ptr(), position_ids.data_ptr(), table_offsets_t.data_ptr(),
            tables_t.data_ptr(), len(tables), self.num_blocks, len(tokens), self._layers.data_ptr(), len(model.layers),
            shape.hidden, shape.heads, shape.kv_heads, shape.head_dim, shape.intermediate, self.block_size, self.eps,
            self.scale, torch.get_num_threads(),
        )
        if status != 0:
            raise RuntimeError(f"decoder_forward failed ({status}) for {len(tokens)} rows")
        if not sample_rows:
            return None
        last = model.norm(hidden[sample_rows])
        return self.lm_head(last).float()
