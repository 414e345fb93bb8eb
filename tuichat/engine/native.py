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
from tuichat.engine.kv_cache import KVCache, ModelShape
from tuichat.engine.runner import flatten

# Families whose decoder layer is exactly: RMSNorm, q/k/v (+bias) with RoPE, full attention, o_proj, residual,
# RMSNorm, SiLU-gated MLP, residual. Qwen3 (q/k norms) or Gemma (scaled embeddings, other norms) are not.
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2")


def unsupported_reason(model, kernel: CpuKernels | None) -> str | None:
    """Why decoder.c can't run this model (None: it can). Expects speed_up_linears to have run."""
    if kernel is None:
        return "no CPU kernels"
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    shape = ModelShape.of(config)
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        return f"{config.model_type} layers are not implemented in C"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"activation {config.hidden_act}"
    if any(kind != "full_attention" for kind in getattr(config, "layer_types", None) or ()):
        return "sliding-window layers"
    if config.model_type == "mistral" and getattr(config, "sliding_window", None):
        return "sliding-window attention"
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

        addresses = []
        for i, layer in enumerate(layers):  # the order of decoder.c's enum
            attn, mlp = layer.self_attn, layer.mlp
            addresses += [
                layer.input_layernorm.weight, attn.fused_q_k_v.weight, attn.fused_q_k_v.bias, attn.o_proj.weight,
                attn.o_proj.bias, layer.post_attention_layernorm.weight, mlp.fused_gate_up.weight,
                mlp.fused_gate_up.bias, mlp.down_proj.weight, mlp.down_proj.bias, kv.k[i], kv.v[i],
            ]
        for tensor in addresses:
            if tensor is not None and not (tensor.is_contiguous() and tensor.dtype is torch.bfloat16):
                raise ValueError("decoder.c needs contiguous bf16 parameters and cache")
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
