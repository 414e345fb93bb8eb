"""The conformance matrix: for every model family tuichat serves (engine/families.py), a tiny random-weight
model in float32 must give transformers' own greedy `generate` output token for token, whatever the engine
does around it: one request alone, requests joining at different steps, chunked prefill, a prefix-cache hit
on a second turn, preemption under a tiny pool. Every prompt but the shortest is longer than the sliding
windows, and the weights are large enough that attention is sharp: a window off by one position, a skipped
softcap or a wrong mask changes tokens. Families tuichat cannot run faithfully are refused by name, and the
docs/models.md's table of families is this file's list."""

from __future__ import annotations

import copy
import functools
import random

import pytest
import torch

from tests.helpers import finished, hf_greedy, step_until, stepping
from tuichat.backends.protocol import SamplingParams, TuichatError
from tuichat.engine import families
from tuichat.engine.engine import Engine, EngineConfig

WINDOW = 24  # every family with sliding windows gets this one: shorter than most prompts below
BASE = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.1,
            eos_token_id=None, bos_token_id=None, pad_token_id=None)

# Each family with the features that make it itself switched on.
FAMILIES = {
    "llama": {},
    "mistral": dict(sliding_window=WINDOW),
    "qwen2": dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1),  # layer 1 windowed
    "qwen3": dict(head_dim=32),  # q/k norms
    "gemma": dict(head_dim=16),
    "gemma2": dict(head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=16, attn_logit_softcapping=2.0,
                   final_logit_softcapping=5.0, layer_types=["sliding_attention", "full_attention"]),
    "gemma3_text": dict(head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=16,
                        layer_types=["sliding_attention", "full_attention"], rope_local_base_freq=100.0),
    "phi3": dict(partial_rotary_factor=0.5, sliding_window=WINDOW),  # fused qkv/gate_up, half the dims rotated
    "olmo2": {},  # q/k norms over all heads, norms after the sublayers
    "granite": dict(attention_multiplier=0.5, embedding_multiplier=2.0, residual_multiplier=0.5, logits_scaling=2.0),
    "starcoder2": dict(sliding_window=WINDOW),  # layer norms with biases, GELU MLP
    "cohere": dict(use_qk_norm=True),  # parallel attention and MLP
}
SCENARIOS = ["alone", "joining", "chunked", "second_turn", "preempted"]


def test_the_matrix_covers_exactly_the_served_families():
    assert sorted(FAMILIES) == sorted(families.VERIFIED)


@functools.cache
def _built(family: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(family, **BASE, **FAMILIES[family])
    torch.manual_seed(sorted(FAMILIES).index(family))
    return AutoModelForCausalLM.from_config(copy.deepcopy(config)).eval()


def pair(family: str):
    """(a model for the engine, an identical reference with its own config object)."""
    reference = _built(family)
    model = copy.deepcopy(reference)
    model.config = copy.deepcopy(reference.config)
    return model


@functools.cache
def expected(family: str, prompt: tuple[int, ...], tokens: int) -> list[int]:
    return hf_greedy(_built(family), list(prompt), tokens)


def prompts_of(lengths, seed):
    rng = random.Random(seed)
    return [[rng.randrange(BASE["vocab_size"]) for _ in range(n)] for n in lengths]


def check(family, engine, prompt, seq, tokens):
    assert seq.finish_reason == "length"
    assert seq.completion_ids == expected(family, tuple(prompt), tokens), f"{family}: differs from generate"


def assert_free(engine):
    assert engine.blocks.num_free == engine.blocks.num_blocks
    assert not engine.scheduler.running and not engine.scheduler.waiting


@pytest.mark.parametrize("scenario", SCENARIOS)
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_greedy_output_is_transformers_generate(family, scenario):
    model = pair(family)
    if scenario == "alone":
        engine = Engine(model, config=EngineConfig(num_blocks=32))
        (prompt,) = prompts_of([57], seed=1)
        (seq,) = engine.generate([prompt], SamplingParams(max_tokens=16))
        check(family, engine, prompt, seq, 16)
    elif scenario == "joining":
        engine = Engine(model, config=EngineConfig(num_blocks=64, max_batched_tokens=48))
        prompts = prompts_of([5, 40, 17, 33], seed=2)
        seqs = []
        for prompt in prompts:  # a new request every two steps while the others decode
            seqs.append(engine.submit(prompt, SamplingParams(max_tokens=12)))
            engine.step()
            engine.step()
        sizes = [engine.last_batch_size for _ in stepping(engine, lambda: finished(seqs), "the replies")]
        assert max(sizes) >= 3
        for prompt, seq in zip(prompts, seqs):
            check(family, engine, prompt, seq, 12)
    elif scenario == "chunked":
        engine = Engine(model, config=EngineConfig(num_blocks=32, max_batched_tokens=7))
        short, long = prompts_of([4, 61], seed=3)
        first = engine.submit(short, SamplingParams(max_tokens=20))
        engine.step()
        second = engine.submit(long, SamplingParams(max_tokens=12))
        engine.step()
        assert 0 < second.num_computed < len(long)  # the long prompt goes in chunks of at most 6 beside a decode
        step_until(engine, lambda: finished([first, second]), "both replies")
        check(family, engine, short, first, 20)
        check(family, engine, long, second, 12)
    elif scenario == "second_turn":
        engine = Engine(model, config=EngineConfig(num_blocks=32))
        first_turn, user = prompts_of([45, 9], seed=4)
        (turn1,) = engine.generate([first_turn], SamplingParams(max_tokens=10))
        prompt = turn1.token_ids + user
        (turn2,) = engine.generate([prompt], SamplingParams(max_tokens=12))
        assert turn2.num_cached_tokens >= len(turn1.token_ids) - engine.blocks.block_size
        check(family, engine, prompt, turn2, 12)
    else:
        # 6 blocks of 16 tokens: two 40-token requests growing by 30 cannot both stay.
        engine = Engine(model, config=EngineConfig(num_blocks=6))
        prompts = prompts_of([40, 41], seed=5)
        seqs = engine.generate(prompts, SamplingParams(max_tokens=30))
        assert engine.scheduler.num_preemptions > 0
        for prompt, seq in zip(prompts, seqs):
            check(family, engine, prompt, seq, 30)
    assert_free(engine)
    engine.close()


def _model(family: str, **overrides):
    from transformers import AutoConfig, AutoModelForCausalLM

    kwargs = {**BASE, **overrides}
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(family, **kwargs)).eval()


@pytest.mark.parametrize("family", ["mamba", "gpt2", "falcon", "deepseek_v3", "mixtral"])
def test_a_family_nobody_verified_is_refused_by_name(family):
    with pytest.raises(TuichatError, match=f"the {family} family is not one tuichat has verified"):
        Engine(_model(family), config=EngineConfig(num_blocks=8))


_FALCON_H1 = dict(mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16, mamba_chunk_size=16)

# Beyond the list, the model itself is checked. Each of these fails a check of its own, so they are tried as if
# their family had been listed: (config overrides, why it is refused, why when the config check is passed by).
REFUSED = {
    "gpt_oss": ({}, "attention arguments tuichat does not implement: .*s_aux", None),  # attention sinks
    # chunked attention: the config names it; the mask function shows it when the config does not
    "llama4_text": (dict(attention_chunk_size=16, no_rope_layers=[1, 1]), "chunked_attention layers", "mask is not causal"),
    "mamba": ({}, "linear_attention layers", "run no attention"),  # no attention at all
    # state-space beside attention in every layer: only serving it in pieces shows it
    "falcon_h1": (_FALCON_H1, "hybrid layers", "does not reproduce its own plain forward"),
}


@pytest.mark.parametrize("family", sorted(REFUSED))
def test_models_the_engine_cannot_run_exactly_are_refused_by_name(family, monkeypatch):
    overrides, why, why_hidden = REFUSED[family]
    monkeypatch.setattr(families, "VERIFIED", (*families.VERIFIED, family))
    model = _model(family, **overrides)
    with pytest.raises(TuichatError, match=f"tuichat cannot run .*{family}.*{why}"):
        Engine(model, config=EngineConfig(num_blocks=8))
    if why_hidden:  # as if the config had not named them: the model itself is checked as well
        monkeypatch.setattr(families, "unsupported", lambda config: None)
        with pytest.raises(TuichatError, match=f"tuichat cannot run .*{family}.*{why_hidden}"):
            Engine(model, config=EngineConfig(num_blocks=8))


def test_a_listed_family_with_an_unknown_attention_feature_is_refused():
    """Gemma 3 as an embedding model attends both ways: a Gemma 3 config, but not the attention we compute."""
    with pytest.raises(TuichatError, match="mask is not causal"):
        Engine(pair_with("gemma3_text", use_bidirectional_attention=True), config=EngineConfig(num_blocks=8))


def pair_with(family: str, **overrides):
    return _model(family, **FAMILIES[family], **overrides)


def test_a_multimodal_model_serves_its_text_model_within_the_text_context_length():
    """Gemma 3 with a vision tower: its top-level config has no context length, its text config has."""
    from transformers import AutoModelForCausalLM, Gemma3Config

    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    config = Gemma3Config(text_config={**BASE, **FAMILIES["gemma3_text"]}, vision_config=vision, mm_tokens_per_image=4)
    torch.manual_seed(7)
    reference = AutoModelForCausalLM.from_config(copy.deepcopy(config)).eval()
    model = copy.deepcopy(reference)
    model.config = copy.deepcopy(config)
    engine = Engine(model, config=EngineConfig(num_blocks=32))
    assert engine.max_model_len == BASE["max_position_embeddings"]
    (prompt,) = prompts_of([40], seed=6)
    (seq,) = engine.generate([prompt], SamplingParams(max_tokens=10))
    assert seq.completion_ids == hf_greedy(reference, prompt, 10)


def test_an_unserved_family_is_refused_before_its_weights_load(tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    from tuichat.backends.local import LocalBackend

    _model("mamba").save_pretrained(tmp_path)
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", lambda *a, **k: pytest.fail("weights were loaded"))
    with pytest.raises(TuichatError, match="tuichat cannot run .*: the mamba family is not one tuichat has verified"):
        LocalBackend().load_sync(str(tmp_path))


def test_sliding_window_layers_give_back_the_kv_that_left_every_window():
    """Gemma 3's sliding layer (layer 0, window 24) keeps only a window's K/V: the pages of the blocks a
    sequence has left behind read as zeros there, not in the full layer. A later prompt sharing only the early
    part of that conversation must not take the released blocks as a prefix hit (its first rows would read
    zeros in the window), while the conversation's own next turn still hits; both as transformers generates."""
    family = "gemma3_text"
    # blocks of 32 positions: a block's K/V in a layer fill a page (2 KV heads of 16 fp32 dims), which can go back
    engine = Engine(pair(family), config=EngineConfig(num_blocks=32, block_size=32))
    assert engine.blocks.window == WINDOW
    bs = engine.blocks.block_size
    (prompt,) = prompts_of([100], seed=8)
    (first,) = engine.generate([prompt], SamplingParams(max_tokens=10))
    check(family, engine, prompt, first, 10)
    released = [b.id for b in engine.blocks.blocks if not b.resident]
    computed = len(first.token_ids) - 1  # the last token has no K/V yet
    assert len(released) == (computed // bs * bs + 1 - WINDOW) // bs  # out of the window of the last full block's end
    for block in released:
        rows = slice(block * bs, (block + 1) * bs)
        assert not engine.kv.k[0][rows].any() and not engine.kv.v[0][rows].any()
        assert engine.kv.k[1][rows].any() and engine.kv.v[1][rows].any()

    early = prompt[:70] + prompts_of([3], seed=9)[0]  # shares 2 full blocks, whose window was released
    (other,) = engine.generate([early], SamplingParams(max_tokens=8))
    assert other.num_cached_tokens == 0
    check(family, engine, early, other, 8)
    # Computed again by `other`, its second block stays resident (the window of its last full block's end reaches
    # into it) and takes the entry from the released twin: a third prompt now hits both blocks
    again = prompt[:70] + prompts_of([4], seed=13)[0]
    (third,) = engine.generate([again], SamplingParams(max_tokens=8))
    assert third.num_cached_tokens == 2 * bs
    check(family, engine, again, third, 8)

    later = first.token_ids + prompts_of([5], seed=10)[0]
    (turn,) = engine.generate([later], SamplingParams(max_tokens=8))
    assert turn.num_cached_tokens >= len(first.token_ids) - bs
    check(family, engine, later, turn, 8)
    assert_free(engine)
    engine.close()


def test_released_blocks_still_come_back_from_disk_after_a_restart(tmp_path):
    """A block goes to the KV disk whole before its sliding layer's pages are released: the next session
    restores the whole conversation, not only what was still resident when the last one closed."""
    family = "gemma3_text"
    config = EngineConfig(num_blocks=32, block_size=32, kv_disk=(tmp_path / "kv", "gemma3"))
    engine = Engine(pair(family), config=config)
    (prompt,) = prompts_of([100], seed=11)
    (first,) = engine.generate([prompt], SamplingParams(max_tokens=10))
    assert any(not b.resident for b in engine.blocks.blocks)
    engine.close()

    again = Engine(pair(family), config=config)
    later = first.token_ids + prompts_of([5], seed=12)[0]
    (turn,) = again.generate([later], SamplingParams(max_tokens=8))
    assert turn.num_restored_tokens == (len(later) - 1) // 32 * 32
    check(family, again, later, turn, 8)
    again.close()
