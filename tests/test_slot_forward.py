"""The native sampler's slot-cache forward computes what the model's own Hugging Face forward does,
for every arch the schema offers (dense, MoE, Qwen3's q/k norms, sliding-window layers), through
ragged prefills, single-token steps, sequences moved between slots and caches kept and restored."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from hpcrl.config import load_job
from hpcrl.data import CharTokenizer
from hpcrl.engines.hf_model import random_model
from hpcrl.engines.slot_forward import SlotCache

TOKENIZER = CharTokenizer()
MOE = ["model.num_experts=4", "model.experts_per_token=2", "model.moe_intermediate_size=32"]
ARCHS = {"qwen2": [], "llama": [], "qwen2_moe": [*MOE, "model.shared_expert_intermediate_size=32"],
         "qwen3_moe": MOE, "mixtral": MOE}


def _model(arch: str) -> torch.nn.Module:
    if arch == "qwen2-sliding":   # the second layer sees only the last 3 positions
        config = Qwen2Config(vocab_size=TOKENIZER.vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, use_sliding_window=True, sliding_window=3,
                             max_window_layers=1)
        torch.manual_seed(0)
        return Qwen2ForCausalLM(config).eval()
    job = load_job("jobs/tiny_grpo.yaml", [f"model.arch={arch}", *ARCHS[arch]])
    return random_model(job.model, TOKENIZER, seed=3).eval()


@pytest.mark.parametrize("arch", [*ARCHS, "qwen2-sliding"])
def test_the_slot_forward_gives_the_models_own_logits_through_steps_moves_and_kept_caches(arch):
    model = _model(arch)
    rng = np.random.default_rng(0)
    ids = torch.from_numpy(rng.integers(3, TOKENIZER.vocab_size, (4, 10)))
    with torch.no_grad():   # the reference: each sequence alone, whole, through transformers' forward
        reference = torch.stack([model(input_ids=row[None]).logits[0] for row in ids])
    cache = SlotCache(model)
    cache.reserve(4, 6)
    prefill = np.array([5, 2, 1, 4])   # ragged: each row's first tokens, right-padded to the longest
    padded = torch.where(torch.arange(5) < torch.from_numpy(prefill)[:, None], ids[:, :5], 0)
    logits = cache.forward(0, padded, torch.zeros(4, dtype=torch.long), torch.from_numpy(prefill), 5)
    torch.testing.assert_close(logits, reference[np.arange(4), prefill - 1], atol=1e-5, rtol=0)
    cache.reserve(4, 16)   # grows: what the slots hold is kept
    filled, first = prefill.copy(), 0
    rows = np.arange(4)   # the sequence in each slot from `first` on
    for step in range(4):
        if step == 2:   # sequence 1 leaves, 3 moves into its slot, and 0 goes on in slot 3 from a kept copy
            kept = cache.take(0, int(filled[0]))
            cache.move(torch.tensor([3]), torch.tensor([1]), int(filled[3]))
            cache.put(3, kept)
            for tensor in cache.keys + cache.values:
                tensor[0] = float("nan")   # slot 0 is no one's now: nothing may read it
            first, rows, filled = 1, rows[[3, 2, 0]], filled[[3, 2, 0]]
        fed = ids[rows, filled].unsqueeze(1)
        logits = cache.forward(first, fed, torch.from_numpy(filled), torch.ones(len(rows), dtype=torch.long),
                               int(filled.max()) + 1)
        torch.testing.assert_close(logits, reference[rows, filled], atol=1e-5, rtol=0)
        filled = filled + 1
