"""`trl_dta.batch`: TRL's padded layout read as sequences and written back, row taking, group ids."""

from __future__ import annotations

import torch

from trl_dta.batch import Layout, group_ids, sequences, take_rows


def _batch():
    # row 0: prompt [5 6 7], completion [8 9]; row 1: prompt [6 7], completion [4]; row 2: prompt [7], no completion
    return {
        "prompt_ids": torch.tensor([[5, 6, 7], [0, 6, 7], [0, 0, 7]]),
        "prompt_mask": torch.tensor([[1, 1, 1], [0, 1, 1], [0, 0, 1]]),
        "completion_ids": torch.tensor([[8, 9], [4, 0], [0, 0]]),
        "completion_mask": torch.tensor([[1, 1], [1, 0], [0, 0]]),
        "advantages": torch.tensor([0.5, -1.0, 2.0]),
        "num_items_in_batch": torch.tensor(3),
        "old_per_token_logps": None,
    }


def test_layout_unpads_and_gathers_back():
    layout = Layout.from_batch(_batch())
    assert [s.tolist() for s in layout.seqs] == [[5, 6, 7, 8, 9], [6, 7, 4], [7]]
    assert layout.lengths == [2, 1, 0] and layout.width == 2
    assert [s.tolist() for s in sequences(_batch())] == [s.tolist() for s in layout.seqs]
    # per-sequence values whose last C_i are row i's completion columns
    values = [torch.tensor([1.0, 2.0, 3.0, 4.0]), torch.tensor([1.0, 5.0]), torch.zeros(0)]
    assert Layout.from_batch(_batch()).gather(values, "cpu").tolist() == [[3.0, 4.0], [5.0, 0.0], [0.0, 0.0]]


def test_layout_refuses_other_paddings():
    batch = _batch()
    batch["prompt_mask"] = torch.tensor([[1, 1, 0], [0, 1, 1], [0, 0, 1]])  # right-padded prompt
    assert Layout.from_batch(batch) is None
    batch = _batch()
    batch["prompt_mask"] = torch.tensor([[0, 0, 0], [0, 1, 1], [0, 0, 1]])  # a completion without prompt
    batch["prompt_ids"] = torch.zeros(3, 3, dtype=torch.long)
    assert Layout.from_batch(batch) is None


def test_take_rows_slices_per_row_entries_only():
    out = take_rows(_batch(), torch.tensor([2, 0]))
    assert out["prompt_ids"].tolist() == [[0, 0, 7], [5, 6, 7]]
    assert out["advantages"].tolist() == [2.0, 0.5]
    assert out["num_items_in_batch"].item() == 3 and out["old_per_token_logps"] is None


def test_group_ids_number_groups_across_processes():
    # 2 processes x 6 rows, groups of 4: rows 0-3 group 0, 4-7 group 1 (straddles), 8-11 group 2
    assert group_ids(0, 6, 4).tolist() == [0, 0, 0, 0, 1, 1]
    assert group_ids(1, 6, 4).tolist() == [1, 1, 2, 2, 2, 2]
