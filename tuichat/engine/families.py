"""What the engine knows of a model from its config alone: whether tuichat serves its family, and its shape.

The model families tuichat serves are those whose greedy output its conformance matrix (tests/test_families.py)
proves identical to transformers' `generate` under batching, chunking, prefix caching and preemption. Any other
family is refused by name before its weights load, even one that might work: a family nobody checked is one
that may say something else than the model would.

At load, attention.inspect and the engine's serving-path check verify the model itself as well, which catches
variants of a listed family (a Qwen2 config with sliding windows, say) and what a config cannot show.
"""

from __future__ import annotations

from dataclasses import dataclass

VERIFIED = (
    "llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "phi3", "olmo2", "granite",
    "starcoder2", "cohere",
)

# Layer kinds of transformers' `config.layer_types` that paged attention computes exactly.
_ATTENTION_LAYERS = {"full_attention", "sliding_attention"}


def text_config(config):
    """The language model's config of a composite (multimodal) one; the config itself otherwise."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def unsupported_family(family: str) -> str | None:
    """Why tuichat refuses models of this model_type (None: it does not)."""
    if family not in VERIFIED:
        return (f"the {family} family is not one tuichat has verified to give transformers' own answers "
                f"(verified: {', '.join(VERIFIED)})")
    return None


def unsupported(config) -> str | None:
    """Why tuichat refuses a model of this config (None: it does not). Cheap: no weights needed."""
    text = text_config(config)
    if (why := unsupported_family(getattr(text, "model_type", None) or "unknown")) is not None:
        return why
    other = sorted(set(getattr(text, "layer_types", None) or ()) - _ATTENTION_LAYERS)
    if other:
        return f"it has {', '.join(other)} layers, which tuichat's paged attention does not compute"
    return None


@dataclass(frozen=True)
class ModelShape:
    """What the engine's cache and kernels need to know of a model's config."""

    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    intermediate: int

    @classmethod
    def of(cls, config) -> ModelShape:
        text = text_config(config)
        heads = text.num_attention_heads
        return cls(
            layers=text.num_hidden_layers,
            heads=heads,
            kv_heads=getattr(text, "num_key_value_heads", None) or heads,
            head_dim=getattr(text, "head_dim", None) or text.hidden_size // heads,
            hidden=text.hidden_size,
            intermediate=text.intermediate_size,
        )
