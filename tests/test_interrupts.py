"""Ending a generation round from the controller, over real MPI ranks (hpcrl.runtime.interrupts).

Run by pytest, this file starts itself as a 2-rank MPI program: rank 0 plays the controller, rank 1
a rollout replica that decodes slowly (50 ms a token, 200 tokens, no <eos>). An interrupt of an
older round, waiting when the round starts, does not stop it; the interrupt of its own round does,
between two decoding steps, and the rows come back unfinished with the tokens they have; a round
after it runs to its budget; an interrupt nobody read is drained at shutdown.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
from conftest import mpi_findings


@pytest.fixture(scope="module")
def findings(tmp_path_factory) -> dict:
    return mpi_findings(__file__, 2, tmp_path_factory.mktemp("interrupts") / "findings.json", timeout=180)


def test_an_older_rounds_interrupt_is_ignored_and_its_own_ends_the_round_between_steps(findings):
    cut = findings["cut"]
    assert cut["unfinished"] == 3, "every row came back unfinished"
    assert 3 <= min(cut["lengths"]) <= max(cut["lengths"]) < 100, "stopped after the interrupt, not before"
    assert cut["seconds"] >= 0.45, "the interrupt of round (0, 0), waiting at the start, did not stop (1, 0)"


def test_a_later_round_runs_to_its_budget_and_a_stray_interrupt_is_drained(findings):
    assert findings["next"] == {"lengths": [5, 5, 5], "unfinished": 0}
    assert findings["drained"] == [[9, 9]]


def _main(out: Path) -> None:
    import numpy as np
    import torch

    from hpcrl.runtime.interrupts import drain_interrupts, interrupt, round_stop
    from hpcrl.runtime.mpi_world import COMM, barrier, poll_recv, send, wait_sends

    if COMM.Get_rank() == 0:
        interrupt([1], (0, 0))                       # an older round's, arrived late
        poll_recv(source=1, tag=1)                   # the replica has started round (1, 0)
        time.sleep(0.5)
        interrupt([1], (1, 0))
        barrier()                                    # round (2, 0) is over
        interrupt([1], (9, 9))                       # never read by a round
        barrier()
        wait_sends()
        return
    from conftest import REPO

    from hpcrl.config import load_job
    from hpcrl.data import CharTokenizer
    from hpcrl.engines.hf_model import random_model
    from hpcrl.engines.native_sampler import NativeSampler, SamplingParams
    from hpcrl.ragged import Ragged

    job = load_job(REPO / "jobs" / "tiny_grpo.yaml", ["model.max_position_embeddings=256"])
    tokenizer = CharTokenizer()
    sampler = NativeSampler(random_model(job.model, tokenizer, job.seed), (), tokenizer.pad_token_id,
                            step_delay_s=0.05)      # -1: no <eos>
    prompts = Ragged.from_rows([tokenizer.encode("1+1=")] * 3, np.int32)
    time.sleep(0.2)                                  # the older interrupt is waiting
    send("started", 0, 1)
    started = time.monotonic()
    cut = sampler.generate(prompts, SamplingParams(200), torch.Generator().manual_seed(0),
                           stop=round_stop(None, (1, 0)))
    seconds = time.monotonic() - started
    after = sampler.generate(prompts, SamplingParams(5), torch.Generator().manual_seed(0),
                             stop=round_stop(None, (2, 0)))
    barrier()
    barrier()
    findings = {"cut": {"lengths": cut.response_ids.lengths.tolist(), "unfinished": int((~cut.finished).sum()),
                        "seconds": seconds},
                "next": {"lengths": after.response_ids.lengths.tolist(), "unfinished": int((~after.finished).sum())},
                "drained": [list(key) for key in drain_interrupts()]}
    out.write_text(json.dumps(findings))
    wait_sends()


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    _main(Path(sys.argv[1]))
