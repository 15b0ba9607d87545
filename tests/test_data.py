"""Tasks, tokenizer, reward and the resumable sampler."""
from __future__ import annotations

import pytest

from hpcrl.data import CharTokenizer, ResumableSampler, SamplerState, addition_prompts
from hpcrl.rewards import answer_reward
from hpcrl.runtime.dispatch import concat_batches, split_batch


def test_tokenizer_round_trip_and_eos():
    tok = CharTokenizer()
    ids = tok.encode("12+34=")
    assert ids[0] == tok.bos_token_id
    assert tok.decode(ids[1:] + [tok.eos_token_id] + tok.encode("9", add_bos=False)) == "12+34="
    with pytest.raises(ValueError, match="not in the task vocabulary"):
        tok.encode("x")


def test_addition_prompts_are_all_pairs():
    prompts = addition_prompts(1)
    assert len(prompts) == 100 and prompts[34].text == "3+4=" and prompts[34].answer == "7"


def test_reward_exact_partial_and_empty():
    assert answer_reward("46", "46", stopped=True) == 1.0
    assert answer_reward("46", "46", stopped=False) == pytest.approx(0.5 * 2 / 3)  # no stop
    assert answer_reward("41", "46", stopped=True) == pytest.approx(0.5 * 2 / 3)  # '4' and the stop
    assert answer_reward("7", "46", stopped=True) == 0.0
    assert answer_reward("", "7", stopped=False) == 0.0


def test_sampler_resumes_exactly_from_its_state():
    items = list(range(10))
    straight = ResumableSampler(items, seed=3)
    batches = [straight.next_batch(4) for _ in range(5)]
    first = ResumableSampler(items, seed=3)
    head = [first.next_batch(4) for _ in range(2)]
    resumed = ResumableSampler(items, seed=3, state=SamplerState(**vars(first.state)))
    assert head + [resumed.next_batch(4) for _ in range(3)] == batches
    assert sorted(batches[0] + batches[1] + batches[2][:2]) == items, "each epoch visits every item once"


def test_split_and_concat_keep_sample_order():
    batch = {"a": list(range(7)), "b": list("abcdefg")}
    shards = split_batch(batch, 3)
    assert [len(s["a"]) for s in shards] == [2, 2, 3]
    assert concat_batches(shards) == batch
