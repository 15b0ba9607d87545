"""The CPU engines: the KV-cache sampler agrees with the trainer token for token."""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import tempfile
from pathlib import Path

from conftest import REPO, random_files

from hpcrl.config import load_job
from hpcrl.data import CharTokenizer
from hpcrl.engines.batch import pack, response_logprobs
from hpcrl.engines.hf_model import random_model
from hpcrl.engines.native_sampler import NativeSampler, SamplingParams, _filter_logits, _inverse_cdf, _uniforms
from hpcrl.ragged import Ragged


def rows(token_lists) -> Ragged:
    return Ragged.from_rows(token_lists, np.int32)


def tiny():
    job = load_job(REPO / "jobs" / "tiny_grpo.yaml")
    tokenizer = CharTokenizer()
    return job, tokenizer, random_model(job.model, tokenizer, job.seed)


def test_same_seed_builds_identical_weights_and_another_seed_does_not():
    job, tokenizer, model = tiny()
    again = random_model(job.model, tokenizer, job.seed)
    other = random_model(job.model, tokenizer, job.seed + 1)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters()))
    assert not all(torch.equal(a, b) for a, b in zip(model.parameters(), other.parameters()))


def test_kv_cache_sampling_logprobs_match_a_full_forward_with_ragged_prompts():
    _, tokenizer, model = tiny()
    prompts = rows([tokenizer.encode(t) for t in ("3+4=", "12+345=", "7=")] * 8)
    sampler = NativeSampler(model, tokenizer.stop_token_ids, tokenizer.pad_token_id)
    out = sampler.generate(prompts, SamplingParams(max_new_tokens=5), torch.Generator().manual_seed(0))
    full, _ = response_logprobs(model, pack(prompts, out.response_ids, tokenizer.pad_token_id), temperature=1.0)
    assert out.finished.all()
    for i, (response, row) in enumerate(zip(out.response_ids, out.logprobs)):
        assert 1 <= len(response) <= 5
        assert tokenizer.eos_token_id not in response[:-1], "generation stops at the first <eos>"
        assert torch.allclose(full[i, : len(row)], torch.from_numpy(row), atol=1e-5)


def test_a_round_stops_each_row_at_its_budget_and_cuts_unfinished_rows_at_the_deadline():
    _, tokenizer, model = tiny()
    sampler = NativeSampler(model, (), tokenizer.pad_token_id)   # no <eos>: only budgets and deadlines end rows
    prompts = rows([tokenizer.encode("1+1=")] * 3)
    out = sampler.generate(prompts, SamplingParams(6), torch.Generator().manual_seed(0), budgets=np.array([2, 0, 5]))
    assert out.response_ids.lengths.tolist() == [2, 0, 5] and out.finished.tolist() == [True, True, True]
    slow = NativeSampler(model, (), tokenizer.pad_token_id, step_delay_s=0.05)
    import time
    deadline = time.monotonic() + 0.2
    cut = slow.generate(prompts, SamplingParams(50), torch.Generator().manual_seed(0),
                        stop=lambda finished: time.monotonic() > deadline)
    assert not cut.finished.any() and 1 <= cut.response_ids.lengths.min() < 50
    assert len(set(cut.response_ids.lengths.tolist())) == 1, "every row of the round got the same steps"


def test_sampling_is_reproducible_from_the_generator_seed():
    _, tokenizer, model = tiny()
    sampler = NativeSampler(model, tokenizer.stop_token_ids, tokenizer.pad_token_id)
    prompts = rows([tokenizer.encode("1+1=")] * 16)
    runs = [sampler.generate(prompts, SamplingParams(4), torch.Generator().manual_seed(s)).response_ids.tolist()
            for s in (5, 5, 6)]
    assert runs[0] == runs[1] and runs[0] != runs[2]


def test_continuous_batching_samples_what_each_prompt_alone_would():
    """Rows leave the batch as they finish and waiting prompts take their slots; every row samples
    from draws of its own seed, so with the same seeds the tokens and log-probs are those of each prompt
    generated alone, for any number of slots, and in lock-step (which decodes every row of a batch
    until the batch's longest has ended: more work for the same tokens). A prompt repeated among
    those admitted together (a group's samples) is prefilled once."""
    _, tokenizer, model = tiny()
    prompts = rows([tokenizer.encode(f"{a}+{b}=") for a, b in [(1, 2), (34, 5), (6, 78), (9, 0), (12, 3)] * 3])
    seeds = np.arange(len(prompts)) * 101 + 7
    params = SamplingParams(12)
    alone = [NativeSampler(model, tokenizer.stop_token_ids, tokenizer.pad_token_id).generate(
        prompts.take(np.array([i])), params, torch.Generator(), seeds=seeds[i:i + 1]) for i in range(len(prompts))]
    lengths = {len(a.response_ids[0]) for a in alone}
    assert len(lengths) > 2, "the responses end at different lengths (else no row would leave early)"
    decoded, prefilled = [], []   # rows of each one-token forward (decoding steps), and of each prefill
    hook = model.model.embed_tokens.register_forward_pre_hook(
        lambda _, args: (decoded if args[0].shape[1] == 1 else prefilled).append(len(args[0])))
    for slots, lockstep in [(None, False), (4, False), (1, False), (None, True), (4, True)]:
        decoded.clear(), prefilled.clear()
        sampler = NativeSampler(model, tokenizer.stop_token_ids, tokenizer.pad_token_id, max_seqs=slots,
                                lockstep=lockstep)
        out = sampler.generate(prompts, params, torch.Generator(), seeds=seeds)
        assert out.response_ids.tolist() == [a.response_ids[0].tolist() for a in alone], slots
        for row, a in zip(out.logprobs, alone):
            assert np.allclose(row, a.logprobs[0], atol=1e-5)
        assert out.finished.all()
        if slots is None:   # all 15 admitted at once: each of the 5 prompts prefilled once
            assert prefilled == [5], prefilled
        lengths = out.response_ids.lengths
        if not lockstep:   # a row is fed each of its tokens but its last, and nothing after it
            assert sum(decoded) == lengths.sum() - len(lengths), slots
        else:              # every row of a batch (prompts in order) is fed until the batch's longest ends
            batches = np.array_split(lengths, np.arange(slots or len(lengths), len(lengths), slots or len(lengths)))
            assert sum(decoded) == sum(len(b) * (b.max() - 1) for b in batches), slots
    hook.remove()


def test_counter_based_draws_follow_the_distribution_and_never_pick_a_masked_token():
    """The batch samples at once from per-(seed, position) uniforms: over many seeds the frequencies
    match the probabilities (a 5-sigma band), a zero-probability token is never drawn, and the
    uniforms of one seed are independent of the others in the batch."""
    probs = torch.tensor([[0.5, 0.0, 0.3, 0.15, 0.05]]).repeat(40_000, 1)
    seeds = np.arange(40_000, dtype=np.uint64) * np.uint64(7919) + np.uint64(3)
    drawn = _inverse_cdf(probs, _uniforms(seeds, np.zeros(40_000, np.int64)))
    freq = torch.bincount(drawn, minlength=5).double() / 40_000
    sigma = (probs[0] * (1 - probs[0]) / 40_000).sqrt()
    assert freq[1] == 0
    assert ((freq - probs[0].double()).abs() <= 5 * sigma + 1e-12).all(), freq
    u = _uniforms(seeds[:3], np.array([0, 1, 2]))
    assert (0 < u).all() and (u < 1).all()
    assert _uniforms(seeds[1:2], np.array([1]))[0] == u[1]
    positions = _uniforms(np.full(20_000, 11, np.uint64), np.arange(20_000))
    assert abs(positions.mean() - 0.5) < 0.01 and abs(np.corrcoef(positions[:-1], positions[1:])[0, 1]) < 0.03


def test_a_deadline_leaves_waiting_prompts_unstarted_and_unfinished():
    import time

    _, tokenizer, model = tiny()
    slow = NativeSampler(model, (), tokenizer.pad_token_id, step_delay_s=0.05, max_seqs=2)
    deadline = time.monotonic() + 0.2
    cut = slow.generate(rows([tokenizer.encode("1+1=")] * 5), SamplingParams(50), torch.Generator().manual_seed(0),
                        stop=lambda finished: time.monotonic() > deadline)
    assert not cut.finished.any() and cut.response_ids.lengths[:2].min() >= 1
    assert cut.response_ids.lengths[2:].tolist() == [0, 0, 0], "the waiting ones start in the next round"


def test_a_round_ends_when_its_needed_rows_have_and_the_others_continue_later():
    """Per-sample hand-out: the first two rows (the batch training takes next) have budgets of 2
    and 3 tokens; the round ends once both have, with the later batch's rows cut where they are."""
    from hpcrl.runtime.interrupts import round_stop

    _, tokenizer, model = tiny()
    sampler = NativeSampler(model, (), tokenizer.pad_token_id)   # no <eos>: the budgets end the rows
    needed = np.array([True, True, False, False])
    out = sampler.generate(rows([tokenizer.encode("1+1=")] * 4), SamplingParams(20), torch.Generator().manual_seed(0),
                           budgets=np.array([2, 3, 20, 20]), stop=round_stop(None, None, needed))
    assert out.finished.tolist() == [True, True, False, False]
    assert out.response_ids.lengths.tolist() == [2, 3, 3, 3]


def test_top_k_and_top_p_keep_the_right_tokens():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    assert torch.isfinite(_filter_logits(logits, 2, 1.0)).tolist() == [[True, True, False, False]]
    assert torch.isfinite(_filter_logits(logits, 0, 0.7)).tolist() == [[True, True, False, False]]
    assert torch.isfinite(_filter_logits(logits, 0, 0.4)).tolist() == [[True, False, False, False]]


def test_temperature_scales_the_logprobs():
    logits = torch.tensor([[2.0, 0.0]])
    from hpcrl.engines.batch import token_logprobs

    cold = token_logprobs(logits, torch.tensor([0]), temperature=0.5)
    assert torch.allclose(cold, torch.log_softmax(logits / 0.5, -1)[:, 0])


def one_train_step(job, lr: float) -> tuple[dict[str, float], bool]:
    """One train_step of a fresh torch trainer on four responses with advantage 1: its metrics, and
    whether any weight moved."""
    from hpcrl.engines.torch_trainer import Samples, TorchTrainer

    tokenizer = CharTokenizer()
    with tempfile.TemporaryDirectory() as tmp:
        trainer = TorchTrainer(random_files(job, tokenizer, Path(tmp)), job, tokenizer.pad_token_id, None)
    prompts, responses = rows([tokenizer.encode("1+2=")] * 4), rows([[6, 2], [5], [7, 2], [4, 4, 2]])
    old = trainer.logprobs(prompts, responses)
    before = [p.clone() for p in trainer.module.parameters()]
    metrics = trainer.train_step(Samples(prompts, responses, {
        "old_logprobs": old, "ref_logprobs": old, "advantages": old.with_values(np.ones(len(old.values), np.float32))}),
        lr)
    return metrics, any(not torch.equal(a, b) for a, b in zip(before, trainer.module.parameters()))


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean"])
def test_tokens_out_of_the_loss_mask_change_nothing_in_the_update(mode):
    """An env's observation tokens (loss mask 0) are context only: whatever their advantages and
    log-probs, the update is the same; without the mask the same change moves the weights."""
    from hpcrl.engines.torch_trainer import Samples, TorchTrainer

    job = load_job(REPO / "jobs" / "tiny_grpo.yaml", [f"algorithm.loss_agg={mode}"])
    tokenizer = CharTokenizer()
    prompts, responses = rows([tokenizer.encode("1+2=")] * 4), rows([[6, 9, 9, 2], [5, 8], [7, 9, 9, 9, 2], [4, 2]])
    mask = responses.with_values(np.ones(len(responses.values), np.float32))
    mask.values[[1, 2, 7, 8, 9]] = 0   # "observations" inside the first and third responses

    def update(advantages: np.ndarray, masked: bool) -> list[torch.Tensor]:
        with tempfile.TemporaryDirectory() as tmp:
            trainer = TorchTrainer(random_files(job, tokenizer, Path(tmp)), job, tokenizer.pad_token_id, None)
        old = trainer.logprobs(prompts, responses)
        columns = {"old_logprobs": old, "advantages": old.with_values(advantages.astype(np.float32))}
        trainer.train_step(Samples(prompts, responses, {**columns, **({"loss_mask": mask} if masked else {})}), 0.01)
        return [p.detach().clone() for p in trainer.module.parameters()]

    base = np.ones(len(responses.values))
    changed = base.copy()
    changed[mask.values == 0] = -50.0
    assert all(torch.equal(a, b) for a, b in zip(update(base, True), update(changed, True)))
    assert not all(torch.equal(a, b) for a, b in zip(update(base, False), update(changed, False)))


def test_every_loss_aggregation_trains():
    for mode in ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean"):
        job = load_job(REPO / "jobs" / "tiny_grpo.yaml", [f"algorithm.loss_agg={mode}"])
        metrics, moved = one_train_step(job, job.train.lr)
        assert torch.isfinite(torch.tensor(metrics["loss"]))
        assert moved, mode


def test_the_learning_rate_follows_train_lr_schedule():
    from hpcrl.engines.lr_schedule import learning_rate

    def rates(*overrides: str) -> list[float]:
        base = ["train.steps=10", "train.lr=1.0", "train.min_lr_ratio=0"]
        train = load_job(REPO / "jobs" / "tiny_grpo.yaml", [*base, *overrides]).train
        return [learning_rate(train, step) for step in range(1, 11)]

    # each step at the schedule's value where it begins, as verl's, Megatron's and HF's schedulers:
    # the first at lr, none at the end value (with min_lr_ratio 0, a step at lr 0 would learn nothing)
    assert rates("train.lr_schedule=constant") == [1.0] * 10
    assert rates("train.lr_schedule=linear") == pytest.approx([1 - s / 10 for s in range(10)])
    cosine = rates("train.lr_schedule=cosine", "train.min_lr_ratio=0.1")
    assert cosine[0] == pytest.approx(1.0) and cosine[5] == pytest.approx(0.55)
    assert cosine[-1] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.9))) and cosine[-1] > 0.1
    assert all(a > b for a, b in zip(cosine, cosine[1:]))
    warm = rates("train.lr_schedule=linear", "train.lr_warmup_steps=4")
    assert warm[:4] == pytest.approx([0.25, 0.5, 0.75, 1.0])
    assert warm[4:] == pytest.approx([1 - s / 6 for s in range(6)])


def test_train_step_trains_at_the_rate_it_is_given():
    job, _, _ = tiny()
    assert [one_train_step(job, lr)[1] for lr in (0.0, 1e-3)] == [False, True]


def test_log_probs_and_entropy_chunked_with_recompute_equal_one_chunk_and_their_gradients_too(monkeypatch):
    """Large logits go a chunk of positions at a time, each recomputed in the backward; logits that fit
    in one chunk are not checkpointed. Both give the same values and gradients."""
    import hpcrl.engines.batch as batch_module

    logits = torch.randn(3, 7, 11, generator=torch.Generator().manual_seed(0))
    tokens = torch.randint(0, 11, (3, 7), generator=torch.Generator().manual_seed(1))
    found = {}
    for name, elements in (("one chunk", 1 << 24), ("chunks of 2 positions", 3 * 11 * 2)):
        monkeypatch.setattr(batch_module, "LOGSOFTMAX_CHUNK_ELEMENTS", elements)
        leaf = logits.clone().requires_grad_()
        logp, entropy = batch_module.chunked_token_stats(leaf, tokens, 0.7, with_entropy=True)
        (logp.sum() + 0.3 * entropy.sum()).backward()
        found[name] = (logp.detach(), entropy.detach(), leaf.grad)
    for one, chunked in zip(found["one chunk"], found["chunks of 2 positions"]):
        torch.testing.assert_close(chunked, one)
    expected = torch.log_softmax(logits / 0.7, dim=-1)
    torch.testing.assert_close(found["one chunk"][0], expected.gather(-1, tokens.unsqueeze(-1)).squeeze(-1))


@pytest.mark.parametrize("arch", ["qwen2", "llama", "qwen3_moe"])
def test_the_prepared_attention_mask_is_the_one_transformers_builds_and_gives_its_logits(arch):
    """Left-padded prompts, right-padded responses: the 4-D mask built for sdpa is transformers' own,
    and the model's logits with it are bit for bit those it computes from the 2-D mask."""
    from transformers.masking_utils import create_causal_mask

    from hpcrl.engines.batch import attention_masks

    moe = ["model.num_experts=4", "model.experts_per_token=2", "model.moe_intermediate_size=32"]
    job = load_job(REPO / "jobs" / "tiny_grpo.yaml", [f"model.arch={arch}", *(moe if "moe" in arch else [])])
    tokenizer = CharTokenizer()
    model = random_model(job.model, tokenizer, job.seed).eval()
    batch = pack(rows([tokenizer.encode(t) for t in ("3+4=", "12+345=", "7=")]), rows([[5, 6], [7], [8, 9, 10]]),
                 tokenizer.pad_token_id)
    mask = attention_masks(model, batch["attention_mask"])
    with torch.no_grad():
        theirs = create_causal_mask(config=model.config, inputs_embeds=model.model.embed_tokens(batch["input_ids"]),
                                    attention_mask=batch["attention_mask"], cache=None,
                                    position_ids=batch["position_ids"])
        width = batch["input_ids"].shape[1]
        assert mask.shape == (3, 1, width, width) and torch.equal(mask, theirs)
        logits = [model(input_ids=batch["input_ids"], attention_mask=m, position_ids=batch["position_ids"]).logits
                  for m in (batch["attention_mask"], mask)]
    real = batch["attention_mask"].bool()
    assert torch.equal(logits[0][real], logits[1][real])


def test_the_attention_mask_is_left_to_transformers_where_its_own_would_differ():
    """No padding (sdpa's is_causal then), eager attention, sliding-window or other layer types, a
    config asking for the router logits (HF's MoE loss reads the mask as 2-D): the 2-D mask as given."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from hpcrl.engines.batch import attention_masks

    _, tokenizer, model = tiny()
    unpadded = torch.ones(2, 5, dtype=torch.long)
    padded = torch.tensor([[0, 1, 1, 1, 0], [1, 1, 1, 1, 1]])
    assert attention_masks(model, unpadded) is unpadded
    assert attention_masks(model, padded).shape == (2, 1, 5, 5)
    model.config.layer_types = ["full_attention", "chunked_attention"]
    assert attention_masks(model, padded) is padded
    model.config.layer_types = ["full_attention", "full_attention"]
    model.config.output_router_logits = True
    assert attention_masks(model, padded) is padded
    model.config.output_router_logits = False
    assert attention_masks(model, padded).shape == (2, 1, 5, 5)
    model.set_attn_implementation("eager")
    assert attention_masks(model, padded) is padded
    sliding = Qwen2ForCausalLM(Qwen2Config(vocab_size=tokenizer.vocab_size, hidden_size=32, intermediate_size=64,
                                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                           use_sliding_window=True, sliding_window=3, max_window_layers=1))
    assert sliding.config._attn_implementation == "sdpa" and attention_masks(sliding, padded) is padded
