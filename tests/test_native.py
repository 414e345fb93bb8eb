"""decoder.c through native.py: the C decoder layers for bf16 steps on CPUs. They must be as close to the
float32 model as transformers' own bf16 code is, and a reply must not depend on how its tokens were batched,
chunked or cached."""

from __future__ import annotations

import copy
import os
import threading

import pytest
import torch

from tests.helpers import echoing_prompts, finished, step_until, stepping, whole_and_row_by_row
from tuichat.backends.protocol import SamplingParams
from tuichat.engine.cpu import native
from tuichat.engine.engine import Engine, EngineConfig
from tuichat.engine.runner import StepChunk

# head_dim 32 (decoder.c needs a multiple of 32); weights larger than the default init, so that attention is
# sharp and a wrong position, mask or head shows in the logits.
SHAPE = dict(vocab_size=320, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=1024, initializer_range=0.08,
             eos_token_id=None, bos_token_id=None, pad_token_id=None)


# The families decoder.c takes, with a sliding window, and in head shapes the embedded model (head_dim 64, 3 query heads per KV head)
# never exercises: head_dim 32 and 128, query heads per KV head 1, 2, 4 and 8 (multi-head, GQA, near-MQA).
HEADS = {
    "llama": {},  # 4 heads of 32 over 2 KV heads
    "qwen2": {},  # with q/k/v biases
    # hidden 256: a 300-row prefill's norms and residual adds pass WORTH_THREADS and run on both threads
    "llama-d128-g1": dict(num_attention_heads=2, num_key_value_heads=2, head_dim=128, hidden_size=256),
    "mistral-d128-g4": dict(num_attention_heads=8, num_key_value_heads=2, head_dim=128, sliding_window=None),
    "qwen2-d32-g8": dict(num_attention_heads=8, num_key_value_heads=1),
    "mistral-w16": dict(sliding_window=16),  # a window shorter than two of the prompts
}


def make(arch: str):
    """(bf16 model for an engine, float32 reference with the same weights); `arch` is a key of HEADS."""
    from transformers import AutoConfig, AutoModelForCausalLM

    family = arch.split("-")[0]
    overrides = {**SHAPE, **HEADS.get(arch, ROW_BLOCKS.get(arch, {}))}
    if family == "qwen2" and "num_attention_heads" in HEADS.get(arch, {}):
        overrides["hidden_size"] = 32 * overrides["num_attention_heads"]  # Qwen2 derives head_dim from it
    config = AutoConfig.for_model(family, **overrides)
    torch.manual_seed(1)
    reference = AutoModelForCausalLM.from_config(copy.deepcopy(config)).eval()
    if family == "qwen2":  # its q/k/v biases start at zero; give them values so the bias path is exercised
        with torch.no_grad():
            for layer in reference.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.1)
    model = AutoModelForCausalLM.from_config(copy.deepcopy(config)).eval()
    model.load_state_dict(reference.state_dict())
    return model.to(torch.bfloat16), reference


PROMPTS = [list(range(3, 40)), [200, 7, 7, 31, 90, 4, 18], list(range(100, 121))]
TABLES = [[0, 1, 2, 3], [10, 11], [20, 21, 22]]


def step_plans():
    """Teacher-forced steps that cover the cases: two prompts whole and one split in two chunks (the second
    starts after cached positions), then a step mixing decodes with the rest of that prompt, then decodes."""
    a, b, c = PROMPTS
    yield [StepChunk(a, 0, TABLES[0], True), StepChunk(b, 0, TABLES[1], True), StepChunk(c[:9], 0, TABLES[2], False)]
    yield [StepChunk([a[-1] + 1], len(a), TABLES[0], True), StepChunk([b[-1] + 1], len(b), TABLES[1], True),
           StepChunk(c[9:], 9, TABLES[2], True)]
    for i in range(3):
        yield [StepChunk([p[-1] + 2 + i], len(p) + 1 + i, t, True) for p, t in zip(PROMPTS, TABLES)]


def full_sequences() -> list[list[int]]:
    return [p + [p[-1] + 1] + [p[-1] + 2 + i for i in range(3)] for p in PROMPTS]


def run_plans(engine: Engine) -> list[torch.Tensor]:
    """Logits of every sampled row, in order."""
    return [engine.runner.execute(plan) for plan in step_plans()]


def reference_logits(reference) -> list[torch.Tensor]:
    """The float32 model over each full sequence, cut into the same sampled rows."""
    with torch.inference_mode():
        per_seq = [reference(torch.tensor([s])).logits[0] for s in full_sequences()]
    a, b, c = PROMPTS
    rows = [[per_seq[0][len(a) - 1], per_seq[1][len(b) - 1]], [per_seq[0][len(a)], per_seq[1][len(b)], per_seq[2][len(c) - 1]]]
    for i in range(3):
        rows.append([per_seq[k][len(p) + 1 + i] for k, p in enumerate(PROMPTS)])
    return [torch.stack(r) for r in rows]


@pytest.mark.parametrize("arch", list(HEADS))
def test_as_close_to_float32_as_transformers_bf16(kernels, arch):
    model, reference = make(arch)
    engine = Engine(model, config=EngineConfig(num_blocks=32))
    assert engine.layers == "C" and engine.runner.native is not None
    c_logits = run_plans(engine)
    engine.runner.native = None  # the same engine through transformers' modules
    for cache in engine.kv.k + engine.kv.v:
        cache.zero_()
    hf_logits = run_plans(engine)
    expected = reference_logits(reference)
    c_error = torch.cat([(got - want).abs() for got, want in zip(c_logits, expected)]).mean()
    hf_error = torch.cat([(got - want).abs() for got, want in zip(hf_logits, expected)]).mean()
    spread = torch.cat(expected).std()
    assert hf_error < 0.1 * spread  # the comparison means something: bf16 noise is small against the logits
    assert c_error <= 1.5 * hf_error, (c_error, hf_error)
    engine.close()


def greedy(engine: Engine, prompts: list[list[int]], tokens: int = 12) -> list[list[int]]:
    seqs = engine.generate(prompts, SamplingParams(max_tokens=tokens, temperature=0.0))
    return [s.token_ids[len(p):] for s, p in zip(seqs, prompts)]


@pytest.mark.parametrize("arch", list(HEADS))
def test_replies_do_not_depend_on_batching_chunking_or_caching(kernels, arch):
    """Exact token equality in bf16: every row takes the same arithmetic whatever else is in its step."""
    model, _ = make(arch)
    prompts = [PROMPTS[0] + PROMPTS[2], PROMPTS[1], PROMPTS[2]]
    alone = Engine(model, config=EngineConfig(num_blocks=64, prefix_cache=False))
    assert alone.layers == "C"
    expected = [greedy(alone, [p])[0] for p in prompts]
    alone.close()

    model, _ = make(arch)
    # 10-token budget: prompts are cut into chunks and share steps with the others' decodes.
    busy = Engine(model, config=EngineConfig(num_blocks=64, max_batched_tokens=10))
    seqs = [busy.submit(prompts[0], SamplingParams(max_tokens=12, temperature=0.0))]
    busy.step()
    seqs += [busy.submit(p, SamplingParams(max_tokens=12, temperature=0.0)) for p in prompts[1:]]
    batch_sizes = [busy.last_batch_size for _ in stepping(busy, lambda: finished(seqs), "the replies")]
    assert max(batch_sizes) == 3
    assert [s.token_ids[len(p):] for s, p in zip(seqs, prompts)] == expected
    # The third prompt is a prefix of the first: served from the cache now, the reply is still the same.
    cached = busy.submit(prompts[2], SamplingParams(max_tokens=12, temperature=0.0))
    step_until(busy, lambda: finished([cached]), "the cached reply")
    assert cached.num_cached_tokens > 0
    assert cached.token_ids[len(prompts[2]):] == expected[2]
    busy.close()
    # Six blocks cannot hold all three: preempted and recomputed, the replies stay the same (one token a step:
    # with speculation the replies can finish before a preemption; test_speculate preempts with it).
    model, _ = make(arch)
    tight = Engine(model, config=EngineConfig(num_blocks=6, speculate="off"))
    assert greedy(tight, prompts) == expected and tight.scheduler.num_preemptions > 0
    tight.close()


# Head shapes that decoder.c compiles (attend()'s list) and so attends several rows of a sequence at once: each
# widened key and value serves all their heads (ROWS_AT_ONCE). head_dim 32 takes the one-row fallback.
ROW_BLOCKS = {"mistral-d64-w40": dict(head_dim=64, sliding_window=40)}


@pytest.mark.parametrize("arch", ["llama-d128-g1", "mistral-d128-g4", "mistral-d64-w40"])
def test_rows_attended_together_are_bitwise_rows_attended_alone(kernels, arch):
    """Rows attended together (ROWS_AT_ONCE) against one row a step, the same bits: parts past 256, blocks that
    straddle 256 and a window's start included."""
    model, _ = make(arch)
    engine = Engine(model, config=EngineConfig(num_blocks=64, prefix_cache=False, max_batched_tokens=512))
    whole, alone = whole_and_row_by_row(engine)
    engine.close()
    assert torch.equal(whole, alone)


def test_steps_beyond_512_rows_take_transformers_path(kernels, monkeypatch):
    model, reference = make("llama")
    engine = Engine(model, config=EngineConfig(num_blocks=64, max_batched_tokens=1024))
    used = []
    original = native.NativeDecoder.execute
    monkeypatch.setattr(native.NativeDecoder, "execute", lambda self, chunks: used.append(len(chunks)) or original(self, chunks))
    prompt = [(7 * i) % 300 + 5 for i in range(600)]
    logits = engine.runner.execute([StepChunk(prompt, 0, list(range(38)), True)])
    assert used == []
    with torch.inference_mode():
        expected = reference(torch.tensor([prompt])).logits[0, -1]
    assert (logits[0] - expected).abs().mean() < 0.05 * expected.std()
    engine.runner.execute([StepChunk([9], 600, list(range(38)), True)])  # the next decode reads that K/V
    assert used == [1]
    engine.close()


def test_unsupported_models_keep_transformers_layers(kernels):
    model, _ = make("llama")
    engine = Engine(model.float(), config=EngineConfig(num_blocks=8))  # float32: no AMX kernel, no C layers
    assert engine.runner.native is None and engine.layers == "transformers"
    engine.close()
    from transformers import LlamaConfig, LlamaForCausalLM

    narrow = LlamaForCausalLM(LlamaConfig(**{**SHAPE, "hidden_size": 64})).eval().to(torch.bfloat16)  # head_dim 16
    engine = Engine(narrow, config=EngineConfig(num_blocks=8))
    assert engine.runner.native is None and "head shape" in engine.layers
    engine.close()


def test_a_plan_outside_the_cache_is_an_error_not_a_crash(kernels):
    model, _ = make("llama")
    engine = Engine(model, config=EngineConfig(num_blocks=8))
    with pytest.raises(RuntimeError, match="a block table or position outside the cache"):
        engine.runner.execute([StepChunk([1, 2, 3], 0, [8], True)])  # block 8 of a pool of 0..7
    with pytest.raises(RuntimeError, match="a block table or position outside the cache"):
        engine.runner.execute([StepChunk([1], 40, [0, 1], True)])  # position 40 needs a third block
    assert engine.runner.execute([StepChunk([1, 2, 3], 0, [7], True)]).shape[0] == 1
    engine.close()


def test_structs_laid_out_otherwise_than_decoder_c_are_refused(kernels, monkeypatch):
    """native.py's ctypes mirrors of layer_weights and step_args must match decoder.c's, field by field: a
    drift is refused at load (the structs' layouts compared) and at the call (size and version checked in C)."""
    import ctypes

    assert kernels.abi == native.abi()
    model, _ = make("llama")
    engine = Engine(model, config=EngineConfig(num_blocks=8))
    decoder = engine.runner.native
    assert engine.layers == "C" and isinstance(decoder, native.NativeDecoder)
    for field, value in (("size", ctypes.sizeof(native.StepArgs) - 8), ("version", native.StepArgs.VERSION + 1)):
        saved = getattr(decoder._args, field)
        setattr(decoder._args, field, value)
        with pytest.raises(RuntimeError, match="arguments laid out for another build"):
            decoder.execute([StepChunk([1, 2, 3], 0, [0], True)])
        setattr(decoder._args, field, saved)
    assert decoder.execute([StepChunk([1, 2, 3], 0, [0], True)]).shape[0] == 1
    engine.close()

    class Swapped(native.LayerWeights):  # two fields in the other order: what a one-sided edit does
        _fields_ = [native.LayerWeights._fields_[1], native.LayerWeights._fields_[0], *native.LayerWeights._fields_[2:]]

    monkeypatch.setattr(native, "LayerWeights", Swapped)
    with pytest.raises(RuntimeError, match="decoder.c's structs differ from native.py's"):
        native.check_abi(kernels)


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2
                    or torch.get_num_threads() < 2, reason="needs two threads on two cores")
def test_a_step_pins_its_callers_workers_never_the_caller(kernels):
    """A new engine thread's OpenMP worker once started on the engine thread's own core, and the first step after
    an idle second ran ~10 ms longer: each worker of a step's caller is pinned to a core of its own. The caller
    keeps its mask (it may be any thread, and a process it starts inherits it)."""
    model, _ = make("llama")
    engine = Engine(model, config=EngineConfig(num_blocks=8))
    seen: dict[str, object] = {}

    def caller() -> None:  # a fresh thread: its OpenMP workers are new
        tasks = set(os.listdir("/proc/self/task"))
        mask = os.sched_getaffinity(0)
        engine.runner.execute([StepChunk([1, 2, 3], 0, [7], True)])
        workers = set(os.listdir("/proc/self/task")) - tasks
        seen["caller"] = (mask, os.sched_getaffinity(0))
        seen["workers"] = [os.sched_getaffinity(int(tid)) for tid in workers]

    thread = threading.Thread(target=caller)
    thread.start()
    thread.join(timeout=60)
    engine.close()
    before, after = seen["caller"]
    assert after == before
    assert seen["workers"] and all(len(mask) == 1 for mask in seen["workers"])


@pytest.fixture(scope="module")
def smollm2_bf16(embedded, session_cache):
    """The embedded model in bf16 (SmolLM2: 3 query heads per KV head, head_dim 64, one of decoder.c's
    compiled-in shapes, which the tiny models above do not reach), float32 greedy continuations of ten chat
    prompts with the float32 logits along them, and the prompts. Ten prompts of 24 tokens, because bf16 noise
    alone moves a mean error over three prompts of 12 by ±40 % between two builds that compute the same thing."""
    from tuichat.engine import loader

    resolved, _, reference, tokenizer = embedded
    patch = pytest.MonkeyPatch()
    patch.setenv("TUICHAT_CACHE_DIR", str(session_cache))
    try:
        model, _ = loader.load(resolved, torch.device("cpu"), torch.bfloat16, with_tokenizer=False)
    finally:
        patch.undo()
    chats = ["What is the capital of France?", "Write a haiku about the sea.", "List three fruits.",
             "Explain photosynthesis briefly.", "How do I reverse a list in Python?", "Tell me a joke about cats.",
             "What is 17 times 23?", "Name the planets of the solar system.", "Why is the sky blue?",
             "Translate 'good morning' into Spanish."]
    prompts = [list(tokenizer.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True,
                                                  return_dict=True)["input_ids"]) for c in chats]
    continuations = []  # each prompt with its 24-token float32 greedy continuation, and the logits along it
    with torch.inference_mode():
        for prompt in prompts:
            full = reference.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                      max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0)[0].tolist()
            continuations.append((prompt, full, reference(torch.tensor([full])).logits[0, len(prompt) - 1:-1]))
    return model, continuations, prompts


def test_embedded_model_replies_do_not_depend_on_batching(kernels, smollm2_bf16):
    model, _, prompts = smollm2_bf16
    prompts = prompts[:3]
    engine = Engine(model, config=EngineConfig(num_blocks=64, prefix_cache=False))
    assert engine.layers == "C"
    expected = [greedy(engine, [p], tokens=10)[0] for p in prompts]
    engine.close()
    busy = Engine(model, config=EngineConfig(num_blocks=64, max_batched_tokens=16))
    assert greedy(busy, prompts, tokens=10) == expected
    busy.close()


def _mean_error(engine: Engine, continuations) -> torch.Tensor:
    """The engine's mean logit error against float32's, teacher-forced along float32's continuations."""
    total = []
    for prompt, full, want in continuations:
        table = list(range(8))
        got = [engine.runner.execute([StepChunk(prompt, 0, table, True)])]
        got += [engine.runner.execute([StepChunk([full[i]], i, table, True)]) for i in range(len(prompt), len(full) - 1)]
        total.append((torch.cat(got) - want).abs().mean())
    return torch.stack(total).mean()


_TRANSFORMERS_BF16: list[torch.Tensor] = []  # its error, measured once: transformers' layers run no build's C layers


def test_embedded_model_is_as_close_to_float32_as_transformers_bf16(kernels, smollm2_bf16):
    model, continuations, _ = smollm2_bf16
    engine = Engine(model, config=EngineConfig(num_blocks=64, prefix_cache=False))
    errors = {"C": _mean_error(engine, continuations)}
    if not _TRANSFORMERS_BF16:
        engine.runner.native = None
        _TRANSFORMERS_BF16.append(_mean_error(engine, continuations))
    errors["transformers"] = _TRANSFORMERS_BF16[0]
    assert errors["C"] <= 1.5 * errors["transformers"], errors
    engine.close()


def test_what_decoder_c_reads_is_checked_in_python_first(kernels, monkeypatch):
    """decoder.c trusts the shapes it is given: a mismatch must be a refusal before the call, never a read
    past an array. A rotary table narrower than the head (a partial rotary factor) keeps transformers' layers."""
    model, _ = make("llama")
    engine = Engine(model, config=EngineConfig(num_blocks=8))
    assert engine.layers == "C"
    rotary = model.model.rotary_emb
    original = type(rotary).forward
    plan = [StepChunk([1, 2, 3], 0, [0], True)]

    def narrow(self, x, position_ids):
        cos, sin = original(self, x, position_ids)
        return cos[..., : cos.shape[-1] // 2], sin[..., : sin.shape[-1] // 2]

    monkeypatch.setattr(type(rotary), "forward", narrow)
    monkeypatch.setattr(engine.runner.native, "rotary", native.RotaryTable(rotary, torch.bfloat16))  # not the cached one
    with pytest.raises(ValueError, match=r"rotary cos as a contiguous bf16 CPU tensor of shape \(\d+, 32\), got \(\d+, 16\)"):
        engine.runner.native.execute(plan)
    monkeypatch.setattr(type(rotary), "forward", original)
    monkeypatch.setattr(engine.runner.native, "rotary", native.RotaryTable(rotary, torch.bfloat16))
    weight = model.model.embed_tokens.weight
    for wrong, words in ((weight.detach()[:, :32].contiguous(), r"the embedding as a contiguous bf16 CPU tensor of shape \(\d+, 128\), got \(\d+, 32\)"),
                         (weight.detach().t().contiguous().t(), "the embedding .* \\(strided\\)"),
                         (weight.detach().half(), "reads the embedding in bf16, not torch.float16")):
        monkeypatch.setattr(engine.runner.native, "embedding", wrong)
        with pytest.raises(ValueError, match=words):
            engine.runner.native.execute(plan)
    monkeypatch.setattr(engine.runner.native, "embedding", None)
    # An id past the vocabulary would read past the embedding: decoder.c refuses it, and the cache is untouched.
    for ids in ([1, 2, weight.shape[0]], [-1]):
        with pytest.raises(RuntimeError, match="a token id or sampled row out of range"):
            engine.runner.native.execute([StepChunk(ids, 0, [0], True)])
    engine.close()
    monkeypatch.undo()
    monkeypatch.setattr(type(rotary), "forward", narrow)
    assert native._rotary_width(make("llama")[0]) == 16
    assert native.unsupported_reason(make("llama")[0], kernels, engine.attention) == "rotary embedding over 16 of 32 head dims"


@pytest.mark.parametrize("rope", [None, {"rope_type": "linear", "factor": 2.0}, {"rope_type": "dynamic", "factor": 2.0}])
def test_rotary_table_gives_transformers_own_cos_sin_at_every_position(rope):
    """The table decoder.c's steps read: exactly what the model's rotary module computes for those positions,
    in both dtypes and past the table's first growth; a variant that rescales with the positions seen
    (dynamic) is never tabled."""
    from transformers import AutoConfig, AutoModelForCausalLM

    overrides = {**SHAPE, "max_position_embeddings": 4096}
    if rope:
        overrides["rope_parameters"] = {"rope_theta": 10000.0, **rope}
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **overrides))
    rotary = model.model.rotary_emb
    for dtype in (torch.float32, torch.bfloat16):
        table = native.RotaryTable(rotary, dtype)
        assert table.static == (rope is None or rope["rope_type"] != "dynamic")
        for positions in ([0], [5, 6, 7], list(range(1000, 1030)), [native.RotaryTable.GROW * 2 + 3], [17]):
            ids = torch.tensor(positions)
            want = [t[0] for t in rotary(torch.empty(0, dtype=dtype), ids[None])]
            got = table(ids)
            assert all(torch.equal(g, w) and g.is_contiguous() for g, w in zip(got, want)), (dtype, positions)


@pytest.mark.parametrize("arch", ["llama", "qwen2-d32-g8"])
def test_long_rows_attend_in_parts_as_close_to_float32_as_transformers_bf16(kernels, arch):
    """Past 256 positions a row's attention runs in parts, merged afterwards (decoder.c: SPLIT): teacher-forced
    across the 512 mark, and from a 250-token prompt past 256, the C layers stay as close to float32 as
    transformers' bf16 layers over the same steps."""
    from tests.helpers import LONG_PROMPTS

    model, reference = make(arch)
    sequences = [p + [(3 * i + 1) % 300 for i in range(10)] for p in LONG_PROMPTS]
    with torch.inference_mode():
        want = torch.cat([reference(torch.tensor([s])).logits[0, len(p) - 1:-1] for s, p in zip(sequences, LONG_PROMPTS)])
    engine = Engine(model, config=EngineConfig(num_blocks=96, prefix_cache=False))
    errors = {}
    for path in ("C", "transformers"):
        engine.runner.native = engine.runner.native if path == "C" else None
        rows = []
        for sequence, prompt in zip(sequences, LONG_PROMPTS):
            table = list(range(engine.blocks.blocks_for(len(sequence))))
            rows.append(engine.runner.execute([StepChunk(sequence[:len(prompt)], 0, table, True)]))
            rows += [engine.runner.execute([StepChunk([sequence[i]], i, table, True)])
                     for i in range(len(prompt), len(sequence) - 1)]
        errors[path] = (torch.cat(rows) - want).abs().mean()
    engine.close()
    assert errors["transformers"] < 0.1 * want.std()
    assert errors["C"] <= 1.5 * errors["transformers"], errors


@pytest.mark.parametrize("arch", ["llama", "qwen2-d32-g8"])
def test_speculation_keeps_the_bf16_replies_of_the_engine_without_it(kernels, arch):
    """Drafts verified by decoder.c, several rows of a sequence in one step beside the other sequences': eight
    replies at once are token for token those of the same engine with speculation off, greedy and seeded
    sampling alike (its rows drawn by sampler.c, each draw keyed by its position)."""
    prompts = echoing_prompts(8, seed=2)
    sampled = SamplingParams(max_tokens=24, temperature=0.3, top_p=0.9, frequency_penalty=0.1, seed=5)
    replies = {}
    for mode in ("off", "ngram"):
        model, _ = make(arch)
        engine = Engine(model, config=EngineConfig(num_blocks=128, max_batched_tokens=32, speculate=mode))
        assert engine.layers == "C" and engine._draw_kernels is not None
        replies[mode] = greedy(engine, prompts, tokens=24)
        if mode == "ngram":
            assert 0 < engine.accepted_tokens < engine.draft_tokens  # drafts both kept and cut
        accepted = engine.accepted_tokens
        replies[mode, "sampled"] = [s.completion_ids for s in engine.generate(prompts, sampled)]
        assert (engine.accepted_tokens > accepted) is (mode == "ngram")
        engine.close()
    assert replies["ngram"] == replies["off"]
    assert replies["ngram", "sampled"] == replies["off", "sampled"] != [r[:24] for r in replies["off"]]
