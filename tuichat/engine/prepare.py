"""Model preparation: the one choice of what runs a step, made once and checked before the engine serves.

`prepare` loads the CPU kernels, packs the weights --quant serves in blocks, fuses the linears, starts the
tensor-parallel ranks, builds the runner (decoder.c over packed or bf16 weights, or transformers' modules with
our linears where they win), checks it against the model's own forward, then moves the KV cache to what the
packed path reads and frees the weights nothing reads any more. The engine gets the runner and the labels the
stats panel and the bench show.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from tuichat.engine import quant
from tuichat.engine.attention import ModelAttention
from tuichat.engine.cpu import build, native
from tuichat.engine.families import ModelShape
from tuichat.engine.fusion import speed_up_linears
from tuichat.engine.kv_cache import BlockManager, KVCache
from tuichat.engine.runner import ModelRunner, StepChunk
from tuichat.engine.types import TuichatError

if TYPE_CHECKING:
    from tuichat.engine.engine import EngineConfig


@dataclass(frozen=True)
class Prepared:
    """What a prepared model serves with, and how (the labels)."""

    runner: object  # a ModelRunner, or parallel.TensorParallelRunner: `execute(chunks)`, maybe `close()`
    kernels: native.CpuKernels | None  # the CPU kernels where built: sampled rows are drawn in C (sampler.c)
    matmul: str  # who runs the linears: "torch", or the kernels' instruction set ("amx", "avx512-bf16", ...)
    layers: str  # who runs the decoder layers of short steps: "C", or "transformers (why not C)"
    weights: str  # how the linear weights are stored: "bfloat16", "Q4_1, Q8_0", ...
    weight_bytes: int  # bytes of weights a decode step reads


def prepare(model, source, config: EngineConfig, kv: KVCache, blocks: BlockManager, found: ModelAttention,
            what: str) -> Prepared:
    """Make `model` (already switched to paged attention; `found` is what attention.inspect saw) ready to serve
    from `kv`. `source` (a types.ResolvedModel) lets tensor-parallel workers load their own copy of the weights
    and locates a GGUF's blocks; `what` names the model in a refusal."""
    first = next(model.parameters())
    device, dtype = first.device, first.dtype
    shape = ModelShape.of(model.config)
    matmul, layers = "torch", "transformers"
    weights = str(dtype).removeprefix("torch.")
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    runner = None
    if config.tp > 1:
        from tuichat.engine import parallel

        parallel.check_shardable(model.config, config.tp)  # before spawning anything
        workers, plan_group, pipes = parallel.start_workers(dict(
            resolved=source, device=device.type, dtype=str(dtype).removeprefix("torch."),
            world=config.tp, num_blocks=blocks.num_blocks, block_size=config.block_size, kv_heads=shape.kv_heads,
            head_dim=shape.head_dim, num_layers=shape.layers,
        ))
        parallel.shard_model(model, 0, config.tp)
        runner = parallel.TensorParallelRunner(model, kv, config.block_size, device, workers, plan_group, pipes)
    kernel = None
    if config.fast_linears and device.type == "cpu" and dtype is torch.bfloat16:
        kernel, matmul = build.load()
    if getattr(model, "tuichat_mapped", None) is not None:
        return _prepare_mapped(model, config, kv, blocks, found, what, kernel, matmul)
    why_no_c = _why_no_c_layers(model, kernel, config, device, dtype, matmul)
    # Before fusion: by the model's own names.
    packed, exact, unpacked = _packed_weights(model, kernel, source, config, why_no_c)
    decoder = None
    if config.fast_linears:  # after sharding: the fused weights are the rank's slices
        # transformers' layers take our linear only where it beat torch's at every row count measured:
        # AMX (without it, ours lost to oneDNN on 512-row prefills: scripts/matmul_bench.py --rows 512).
        speed_up_linears(model, kernel if kernel is not None and kernel.isa == "amx" else None)
        if kernel is not None and runner is None:
            why_not = native.unsupported_reason(model, kernel, found)
            if why_not is None:
                try:
                    decoder = native.NativeDecoder(model, kv, config.block_size, kernel, windows=found.windows)
                    layers, weights, weight_bytes = "C", decoder.formats, decoder.weight_bytes
                except ValueError as exc:
                    why_not = str(exc)
            if why_not is not None:
                layers = f"transformers ({why_not})"
    runner = runner or ModelRunner(model, kv, config.block_size, device, decoder)
    try:
        # With the model's own weights: what it checks is the model's structure. Packed weights are the
        # kernels' business (tested apart), and their int8 inputs move the logits by more than rounding.
        check_serving_path(runner, found, blocks, dtype, what)
    except BaseException:
        if hasattr(runner, "close"):
            runner.close()  # tensor-parallel workers must not outlive a refused model
        raise
    if packed and decoder is not None:
        # Packed weights run over an f16 cache (decoder.c): the same bytes reread, as nothing is cached yet.
        kv.k, kv.v = ([t.view(torch.float16) for t in cache] for cache in (kv.k, kv.v))
        decoder = native.NativeDecoder(model, kv, config.block_size, kernel, packed, exact, windows=found.windows)
        layers, weights, weight_bytes = "C", decoder.formats, decoder.weight_bytes
        _drop_bf16_copies(model, "lm_head" in packed, decoder.embedding is not None)
        runner = ModelRunner(model, kv, config.block_size, device, decoder)
    elif config.quant in quant.QUANT_FORMATS:  # asked for, not served: say why, never silently
        why = unpacked or layers.partition(" (")[2].removesuffix(")") or "no linear of this model fits them"
        weights += f" ({config.quant} needs the C layers: {why})"
    return Prepared(runner, kernel, matmul, layers, weights, weight_bytes)


def _prepare_mapped(model, config: EngineConfig, kv: KVCache, blocks: BlockManager, found: ModelAttention, what: str,
                    kernel, matmul: str) -> Prepared:
    """A GGUF served from its map (mapped.py): decoder.c runs every step over the file's blocks; the check is
    against transformers' layers over the same blocks."""
    mapped = model.tuichat_mapped
    why_not = _why_no_c_layers(model, kernel, config, torch.device("cpu"), torch.bfloat16, matmul)
    why_not = why_not or native.unsupported_reason(model, kernel, found)
    if why_not is not None:
        raise TuichatError(f"tuichat cannot serve {what} from the file here: {why_not}.")
    kv.k, kv.v = ([t.view(torch.float16) for t in cache] for cache in (kv.k, kv.v))
    decoder = native.NativeDecoder(model, kv, config.block_size, kernel, mapped.packed, mapped.exact,
                                   mapped.embedding.rows, found.windows)
    runner = ModelRunner(model, kv, config.block_size, torch.device("cpu"), decoder)
    check_serving_path(runner, found, blocks, torch.bfloat16, what, packed=True)
    return Prepared(runner, kernel, matmul, "C", decoder.formats, decoder.weight_bytes)


def _packed_weights(model, kernel, source, config: EngineConfig, why_no_c: str | None) -> tuple[dict, dict, str | None]:
    """(the linears --quant serves in blocks where the C layers will run them, {} for none; the checkpoint's
    fp32 embedding and norms to run beside them (quant.exact_tensors); why none, where it can be told before
    the linears are fused): a GGUF's own blocks, or a dense model's int8/int4."""
    mode, gguf = config.quant, getattr(source, "kind", None) == "gguf"
    if mode == "none" or (mode == "auto" and not gguf):
        return {}, {}, None
    if why_no_c is not None:
        return {}, {}, why_no_c
    converted = getattr(source, "converted_dir", None) if gguf else None
    converted = converted if converted is not None and converted.is_dir() else None
    cache = config.quant_cache or (converted / quant.cache_name(mode) if converted is not None else None)
    checkpoint = config.quant_source or converted
    packed = quant.packed_weights(model, kernel, mode, source.source if gguf else None, checkpoint, cache)
    return packed, quant.exact_tensors(model, checkpoint) if packed else {}, None


def _why_no_c_layers(model, kernel, config: EngineConfig, device: torch.device, dtype: torch.dtype,
                     matmul: str) -> str | None:
    """Why decoder.c will not run this model, as far as it shows before the linears are fused (None: it may)."""
    if device.type != "cpu":
        return f"they run on a CPU, not {device.type}"
    if dtype is not torch.bfloat16:
        return f"they run in bfloat16, not {str(dtype).removeprefix('torch.')}"
    if not config.fast_linears:
        return "fast linears are off"
    if kernel is None:
        return f"no CPU kernels: {matmul}"
    if config.tp != 1:
        return f"not with tensor parallelism (tp {config.tp})"
    if getattr(model, "hf_device_map", None):
        return "not with a device map"
    return native.family_reason(model.config, getattr(model, "tuichat_mapped", None) is not None)


def _drop_bf16_copies(model, packed_head: bool, fp32_embedding: bool) -> None:
    """With the decoder layers served from packed weights, their bf16 copies are dead weight: free them. The
    layers' modules stay, weightless; every step of such a model runs through decoder.c. So does the lm_head's
    copy when it is packed too, unless it is (tied) the embedding and the decoder reads that in bf16."""
    modules = [m for layer in model.model.layers for m in
               (layer.self_attn.fused_q_k_v, layer.self_attn.o_proj, layer.mlp.fused_gate_up, layer.mlp.down_proj)]
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    if packed_head and (not tied or fp32_embedding):
        modules.append(model.lm_head)
    if fp32_embedding:
        modules.append(model.model.embed_tokens)
    for module in modules:
        module.weight = torch.nn.Parameter(module.weight.new_empty(0), requires_grad=False)


def check_serving_path(runner, found: ModelAttention, blocks: BlockManager, dtype: torch.dtype, what: str,
                       packed: bool = False) -> None:
    """The probe's tokens once more, through the path that will serve them: a prefill chunk, a chunk that
    reads it back from the cache, a decode. The last logits must be the probe's plain forward's. This is
    where what attention cannot show surfaces: state kept outside the KV cache (a recurrent or state-space
    layer beside attention) would make the pieces disagree with the whole."""
    ids = found.token_ids
    table = list(range(blocks.blocks_for(len(ids))))
    if len(table) > blocks.num_blocks:
        return  # a pool this small is a test's; nothing is served from it anyway
    cuts = [0, len(ids) - 3, len(ids) - 1, len(ids)]
    for a, b in zip(cuts, cuts[1:]):
        logits = runner.execute([StepChunk(ids[a:b], a, table, b == len(ids))])
    want = found.logits.to(logits.device)
    error = float((logits[0] - want).abs().max() / want.abs().max().clamp_min(1e-6))
    # Rounding alone: float32 differs in the last bits (~1e-6); bf16 steps by ~1 % of the range. `packed` (the
    # runner's f16 cache against the probe's fp32 K and V): rounding K and V to f16 alone moves the probe's logits
    # by 3 % of the range on SmolLM2-135M's Q4_1 file and 6 % on a random-weight 1B (docs/design/kernels.md). A
    # structural fault is off by tens of %.
    if error > (1e-4 if dtype is torch.float32 else 0.15 if packed else 0.05):
        raise TuichatError(
            f"tuichat cannot run {what} faithfully: served in pieces through its KV cache, it does not reproduce "
            f"its own plain forward (off by {error:.0%} of the logit range). It may keep state outside attention."
        )
