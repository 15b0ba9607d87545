"""Packed token columns: rows, padding both ways, joins, shards, and what a message of them costs."""
from __future__ import annotations

import pickle

import numpy as np
import pytest

from hpcrl.ragged import Ragged, batch_nbytes, concat_batches, split_batch

ROWS = [[1, 2, 3], [], [4], [5, 6]]


def test_rows_round_trip_and_slices_are_views():
    r = Ragged.from_rows(ROWS, np.int32)
    assert r.tolist() == ROWS and r.lengths.tolist() == [3, 0, 1, 2] and len(r) == 4
    assert r[0].tolist() == [1, 2, 3] and r[1].tolist() == []
    part = r.slice(2, 4)
    assert part.tolist() == [[4], [5, 6]] and np.shares_memory(part.values, r.values)
    assert r.take(np.array([3, 0])).tolist() == [[5, 6], [1, 2, 3]]
    assert Ragged.from_arrays([np.array(x, np.int32) for x in ROWS], np.int32).equals(r)
    assert Ragged.concat([r.slice(0, 1), r.slice(1, 4)]).equals(r)


def test_padding_right_and_left_and_back():
    r = Ragged.from_rows(ROWS, np.int32)
    right = r.padded(pad=-1)
    assert right.tolist() == [[1, 2, 3], [-1, -1, -1], [4, -1, -1], [5, 6, -1]]
    assert r.padded(pad=0, left=True).tolist() == [[1, 2, 3], [0, 0, 0], [0, 0, 4], [0, 5, 6]]
    assert r.padded(width=2).tolist() == [[1, 2], [0, 0], [4, 0], [5, 6]], "longer rows are cut at the end"
    assert Ragged.from_padded(right, r.lengths).equals(r)


def test_rows_join_prompt_then_response_and_sum():
    prompts = Ragged.from_rows([[1, 9], [1], [1, 8, 8]], np.int32)
    responses = Ragged.from_rows([[5], [], [6, 7]], np.int32)
    assert Ragged.concat_rows(prompts, responses).tolist() == [[1, 9, 5], [1], [1, 8, 8, 6, 7]]
    floats = Ragged.from_rows([[0.5, 0.25], [], [1.0]], np.float32)
    assert floats.row_sums().tolist() == [0.75, 0.0, 1.0]
    with pytest.raises(ValueError, match="3 rows cannot be joined with 2"):
        Ragged.concat_rows(prompts, responses.slice(0, 2))


def test_batches_split_into_contiguous_shards_and_concatenate_back():
    batch = {"ids": Ragged.from_rows(ROWS, np.int32), "reward": np.arange(4.0), "answer": list("abcd")}
    shards = split_batch(batch, 3)
    assert [len(s["answer"]) for s in shards] == [1, 1, 2]
    back = concat_batches(shards)
    assert back["ids"].equals(batch["ids"]) and back["reward"].tolist() == [0, 1, 2, 3] and back["answer"] == list("abcd")
    assert batch_nbytes(batch) == 6 * 4 + 5 * 8 + 4 * 8


def test_a_pickled_column_carries_its_bytes_out_of_band():
    r = Ragged(np.arange(1_000_000, dtype=np.int32), np.array([0, 400_000, 1_000_000], dtype=np.int64))
    buffers: list = []
    header = pickle.dumps(r, protocol=5, buffer_callback=buffers.append)
    assert len(header) < 500 and sum(memoryview(b).nbytes for b in buffers) == r.nbytes
    assert pickle.loads(header, buffers=buffers).equals(r)
