"""Speculative decoding from the sequence's own n-grams: with it on, every reply is the one without it, token
for token (greedy against transformers' `generate`, seeded sampling against the engine with it off), through
batching, chunked prefill, prefix-cache hits, preemption, stop strings, max_tokens and cancel; and no block
holding a rejected token is ever published."""

from __future__ import annotations

import pytest

from tests.helpers import echoing_prompts, finished, hf_greedy, make_tiny, step_until
from tuichat.backends.protocol import SamplingParams
from tuichat.engine.engine import Engine, EngineConfig
from tuichat.engine.kv_cache import block_digest
from tuichat.engine.request import Status
from tuichat.engine.speculate import MAX_DRAFT, PRIOR_ROW_SHARE, NgramProposer, StepCost, draft_length


def engine(mode: str = "ngram", sharpen: float = 1.0, **config) -> tuple[Engine, object]:
    """`sharpen` scales the lm_head: a confident model, whose samples repeat its context as a real one's do."""
    import torch

    model, reference = make_tiny()
    with torch.no_grad():
        model.lm_head.weight.mul_(sharpen)
    return Engine(model, config=EngineConfig(speculate=mode, **{"num_blocks": 256, **config})), reference


def drive(engine: Engine, prompts, params, stagger: int = 0) -> list:
    """Submit each prompt `stagger` steps after the one before, and step until every one has finished."""
    seqs = []
    for prompt in prompts:
        seqs.append(engine.submit(prompt, params))
        for _ in range(stagger):
            engine.step()
    step_until(engine, lambda: finished(seqs), "every reply")
    return seqs


def assert_nothing_leaked(engine: Engine, seqs) -> None:
    """Every block free; every block the prefix cache knows holds a run of some reply's real tokens (a block
    with a rejected draft token in it would hash to something no sequence's tokens give)."""
    assert engine.blocks.num_free == engine.blocks.num_blocks and not engine.scheduler.running
    bs, real = engine.blocks.block_size, set()
    for seq in seqs:
        parent = None
        for i in range(len(seq.token_ids) // bs):
            parent = block_digest(parent, tuple(seq.token_ids[i * bs : (i + 1) * bs]))
            real.add(parent)
    assert engine.blocks.by_hash and set(engine.blocks.by_hash) <= real


def test_the_proposer_finds_the_latest_earlier_occurrence_of_the_longest_suffix():
    proposer = NgramProposer()  # one per sequence, fed its tokens as they grow
    tokens = [1, 2, 3, 4, 9, 2, 3, 5, 6, 2, 3]
    assert proposer.propose(tokens, 1) == [5]  # "2 3" last ended at 6, followed by 5 6 2; the limit is 1
    assert proposer.propose(tokens, 3) == [5, 6, 2]
    assert proposer.propose(tokens + [4], 3) == [9, 2, 3]  # the longest suffix found, "2 3 4", ended at 3
    assert NgramProposer().propose([7, 8, 9, 7], 3) == []  # one token repeated is too short a match
    assert proposer.acceptance == 0.5  # the prior
    proposer.verified(4, 4)
    high = proposer.acceptance
    proposer.verified(4, 1)
    assert high > proposer.acceptance > 0.5
    for _ in range(5):
        proposer.verified(4, 0)
    assert proposer.acceptance < 0.4  # five outright misses outweigh the older hits
    for _ in range(30):  # nothing proposed: back towards the prior, so the sequence tries again
        proposer.verified(0, 0)
    assert proposer.acceptance == pytest.approx(0.5, abs=0.01)


def test_a_draft_is_as_long_as_its_last_token_is_worth_its_row():
    assert draft_length(0.5, 0.15) == 2  # 0.5**2 = 0.25 > 0.15 > 0.5**3
    assert draft_length(0.9, 0.5) == 6 and draft_length(0.4, 0.5) == 0 and draft_length(1.0, 0.5) == MAX_DRAFT
    cost = StepCost()
    assert cost.row_share(1) == pytest.approx(PRIOR_ROW_SHARE)  # nothing timed yet
    for i in range(64):  # steps of 1 to 8 rows taking 8 ms plus 2 ms a row: dearer rows than the prior's
        rows = 1 + i % 8
        cost.add(rows, 0.008 + 0.002 * rows)
    assert cost.row_share(1) == pytest.approx(2 / 10) and cost.row_share(8) == pytest.approx(2 / 24)
    cheap = StepCost()
    for i in range(64):  # rows cheaper than the prior says: the prior stands
        cheap.add(1 + i % 8, 0.008 + 0.0001 * (1 + i % 8))
    assert cheap.row_share(1) == pytest.approx(PRIOR_ROW_SHARE)


def test_greedy_replies_are_generates_with_drafts_accepted_and_rejected():
    spec, reference = engine(max_batched_tokens=64)
    prompts = echoing_prompts(8)
    seqs = drive(spec, prompts, SamplingParams(max_tokens=24), stagger=2)  # joining while others decode
    for prompt, seq in zip(prompts, seqs):
        assert seq.completion_ids == hf_greedy(reference, prompt, 24)
    assert 0 < spec.accepted_tokens < spec.draft_tokens  # both ways really happened
    assert spec.sampled_steps < spec.sampled_tokens  # more than one token per step
    assert_nothing_leaked(spec, seqs)


def test_seeded_sampling_is_the_same_with_speculation_on_or_off():
    """The draw for a position depends on the seed and the position only, so a verified run keeps exactly the
    tokens one-token steps would have drawn."""
    prompts = echoing_prompts(6, seed=5)
    params = SamplingParams(max_tokens=40, temperature=0.5, top_p=0.95, seed=11, frequency_penalty=0.2)
    replies = {}
    for mode in ("off", "ngram", "greedy"):
        eng, _ = engine("off" if mode == "off" else "ngram", sharpen=20)
        sampling = SamplingParams(max_tokens=40) if mode == "greedy" else params
        replies[mode] = [s.completion_ids for s in drive(eng, prompts, sampling, stagger=1)]
        if mode == "ngram":
            assert 0 < eng.accepted_tokens < eng.draft_tokens
    assert replies["ngram"] == replies["off"] != replies["greedy"]  # the same draws, and really sampled


@pytest.mark.parametrize("config", [dict(max_batched_tokens=6), dict()], ids=["chunked-prefill", "whole-prefill"])
def test_speculation_keeps_generates_replies_through_the_next_turns_cache_hit(config):
    """Turn 2 re-sends turn 1 and its reply (whose blocks were published as its drafts were accepted): it hits
    the cache for them, and its reply is generate's for the whole history."""
    spec, reference = engine(**config)
    prompts = echoing_prompts(4, seed=7)
    seqs = drive(spec, prompts, SamplingParams(max_tokens=20), stagger=1)
    for prompt, seq in zip(prompts, seqs):
        assert seq.completion_ids == hf_greedy(reference, prompt, 20)
    history = seqs[0].token_ids + prompts[1][:3]
    (turn2,) = drive(spec, [history], SamplingParams(max_tokens=20))
    assert turn2.completion_ids == hf_greedy(reference, history, 20)
    # Every full block of turn 1's computed tokens (all but its last, sampled token), kept drafts included,
    # even those kept in the step that ended the reply.
    assert turn2.num_cached_tokens == (len(seqs[0].token_ids) - 1) // 16 * 16 > 0 and spec.accepted_tokens > 0
    assert_nothing_leaked(spec, seqs + [turn2])


def test_preemption_under_a_tiny_pool_keeps_generates_replies():
    # 6 blocks of 16 tokens: two requests of ~40 growing by 30 tokens cannot both stay.
    spec, reference = engine(num_blocks=6)
    prompts = [[(17 * i + 3 * j) % 320 for j in range(8)] * 5 for i in (1, 2)]
    seqs = drive(spec, prompts, SamplingParams(max_tokens=30))
    assert spec.scheduler.num_preemptions > 0 and spec.accepted_tokens > 0
    for prompt, seq in zip(prompts, seqs):
        assert seq.completion_ids == hf_greedy(reference, prompt, 30)
    assert_nothing_leaked(spec, seqs)


def test_max_tokens_ends_the_reply_where_it_would_have_inside_an_accepted_run_and_its_blocks_are_kept():
    prompt = echoing_prompts(1, seed=9)[0]
    off, _ = engine("off")
    (whole,) = drive(off, [prompt], SamplingParams(max_tokens=30))
    for cap in range(1, 31):
        spec, _ = engine()  # its own cache: what an earlier cap computed must not stand in for this one's
        (seq,) = drive(spec, [prompt], SamplingParams(max_tokens=cap))
        assert seq.completion_ids == whole.completion_ids[:cap] and seq.finish_reason == "length"
        # The blocks the last step filled with kept drafts were published as the reply ended: the history hits
        # the cache for every full block of its computed tokens (all but the last, sampled one).
        (again,) = drive(spec, [seq.token_ids], SamplingParams(max_tokens=1))
        assert again.num_cached_tokens == (len(seq.token_ids) - 1) // 16 * 16, cap
    assert spec.accepted_tokens > 0 and spec.blocks.num_free == spec.blocks.num_blocks


def test_a_stop_string_inside_an_accepted_run_ends_the_reply_exactly_there(embedded):
    """The embedded model (float32) copying a sentence it was given: stop strings cut from its reply end the
    speculative reply where they end the plain one."""
    from tests.helpers import template_ids
    from tuichat.backends.protocol import Message

    _, model, _, tokenizer = embedded
    prompt = template_ids(tokenizer, [Message("user", "Repeat this exactly: the quick brown fox jumps over the "
                                                       "lazy dog, and the lazy dog sleeps in the warm sun.")])

    # One engine a mode, a request a reply (the prompt's blocks come from the prefix cache after the first).
    engines = {mode: Engine(model, tokenizer, EngineConfig(speculate=mode, num_blocks=64)) for mode in ("off", "ngram")}

    def reply(mode: str, stop: tuple[str, ...] = ()) -> str:
        eng, texts = engines[mode], []
        seq = eng.submit(prompt, SamplingParams(max_tokens=32, stop=stop), lambda out: texts.append(out.text))
        step_until(eng, lambda: finished([seq]), f"the {mode} reply")
        return "".join(texts)

    whole = reply("off")
    assert reply("ngram") == whole and engines["ngram"].accepted_tokens > 0
    for start in range(4, len(whole) - 3, 7):  # stops all along the reply: inside accepted runs, and not
        stop = whole[start : start + 3]
        assert reply("ngram", (stop,)) == reply("off", (stop,)) == whole[: whole.index(stop)]
    for eng in engines.values():
        eng.close()


def test_cancel_mid_speculation_frees_every_block():
    spec, _ = engine()
    prompt = echoing_prompts(1, seed=9)[0]
    seq = spec.submit(prompt, SamplingParams(max_tokens=200))
    step_until(spec, lambda: spec.accepted_tokens > 0, "a draft accepted", limit=100)
    spec.cancel(seq.id)
    spec.step()
    assert seq.status is Status.FINISHED and seq.finish_reason == "cancelled"
    assert spec.blocks.num_free == spec.blocks.num_blocks and not spec.scheduler.running


def test_auto_drafts_for_one_stream_and_not_for_many_ngram_always_off_never():
    """Over the first steps, before the engine has timed enough of them to fit its own cost (the prior's: a row
    costs 15 % of a one-row step), auto drafts with the prior acceptance of 1/2 for one sequence, and for eight
    decoding together not at all: a draft token would have to be kept more than half the time to pay. The
    prompts are histories that already repeat themselves, so there is something to propose at once."""
    off, _ = engine("off")
    histories = [s.token_ids for s in drive(off, echoing_prompts(8, seed=4), SamplingParams(max_tokens=40))]

    def drafted(mode: str, batch) -> bool:
        eng, _ = engine(mode)
        for history in batch:
            eng.submit(history, SamplingParams(max_tokens=40))
        for _ in range(10):
            eng.step()
        return eng.draft_tokens > 0

    for mode, alone, together in (("auto", True, False), ("ngram", True, True), ("off", False, False)):
        assert any(drafted(mode, [h]) for h in histories) is alone, mode
        assert drafted(mode, histories) is together, mode


def test_switching_the_mode_mid_reply_keeps_generates_reply_and_off_drafts_nothing_more():
    """The bench compares the modes on one engine: a switch applies from the next step, to the running requests
    too (a draft proposed before a switch to off is not verified after it)."""
    spec, reference = engine("ngram")
    prompt = echoing_prompts(1, seed=9)[0]
    seq = spec.submit(prompt, SamplingParams(max_tokens=60))
    step_until(spec, lambda: spec.accepted_tokens > 0, "a draft accepted", limit=60)
    spec.set_speculate("off")
    spec.step()
    drafted = spec.draft_tokens
    step_until(spec, lambda: finished([seq]) or seq.num_completion_tokens >= 40, "40 tokens")
    assert spec.draft_tokens == drafted and spec.config.speculate == "off"
    spec.set_speculate("ngram")
    step_until(spec, lambda: finished([seq]), "the reply")
    assert spec.draft_tokens > drafted
    assert seq.completion_ids == hf_greedy(reference, prompt, 60)
    with pytest.raises(ValueError, match="speculate must be one of auto, ngram, off"):
        spec.set_speculate("always")
