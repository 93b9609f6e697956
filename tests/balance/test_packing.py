"""`trl_dta.balance.packing`: exact incremental rank statistics, packed and best strategies, whole groups."""

import random

from hypothesis import given
from hypothesis import strategies as st

from trl_dta.balance import partition
from trl_dta.balance.cost import SortedBatch
from trl_dta.balance.packing import LcpTable, RankForest
from trl_dta.tree import PrefixTree

from .references import SETTINGS, batch_st, check_is_partition, model_st, reference_cost, reference_stats


@SETTINGS
@given(seqs=batch_st, data=st.data())
def test_rank_forest_incremental_statistics(seqs, data):
    # The packer's O(log n) block insert/remove keeps a rank's statistics equal to a rebuilt tree's.
    tree = PrefixTree.from_sequences(seqs)
    batch = SortedBatch(tree)
    n = len(seqs)
    cuts = sorted(set(data.draw(st.lists(st.integers(0, n), max_size=6)) + [0, n]))
    blocks = [(a, b) for a, b in zip(cuts[:-1], cuts[1:]) if b > a]

    def block_stats(l, r):
        return [int(x) for i, x in enumerate(batch.run_stats(l, r)) if i != 1]

    forest = RankForest(batch.lengths.tolist(), LcpTable(batch.lcp), block_stats)
    held = set()
    for step in data.draw(st.lists(st.sampled_from(range(len(blocks))), max_size=10) if blocks else st.just([])):
        if step in held:
            forest.remove([blocks[step]])
            held.discard(step)
        else:
            forest.insert([blocks[step]])
            held.add(step)
        ref = reference_stats([seqs[i] for p in sorted(forest.positions().tolist()) for i in [tree.order[p]]])
        assert forest.components == [ref.sequences, ref.tree_tokens, ref.attention_work, ref.leaves]


@SETTINGS
@given(seqs=batch_st, k=st.integers(1, 5), model=model_st, data=st.data())
def test_best_and_packed_strategies(seqs, k, model, data):
    n = len(seqs)
    group_ids = data.draw(st.none() | st.lists(st.integers(0, 3), min_size=n, max_size=n))
    contiguous = partition(seqs, k, cost_model=model, group_ids=group_ids, strategy="contiguous")
    packed = partition(seqs, k, cost_model=model, group_ids=group_ids, strategy="packed")
    best = partition(seqs, k, cost_model=model, group_ids=group_ids)
    for result in (packed, best):
        check_is_partition(result, n, k)
        for part, cost, stats in zip(result.parts, result.costs, result.stats):
            assert stats == reference_stats([seqs[i] for i in part])
            assert cost == reference_cost([seqs[i] for i in part], model)
        if group_ids is None:
            assert sum(len(p) > 0 for p in result.parts) == min(n, k), "no empty part while sequences are left"
        else:
            owner = {}
            for rank, part in enumerate(result.parts):
                for i in part:
                    assert owner.setdefault(group_ids[i], rank) == rank, "a group was split across parts"
            assert sum(len(p) > 0 for p in packed.parts) == min(len(set(group_ids)), k)
    assert best.max_cost <= min(contiguous.max_cost, packed.max_cost)


def test_packed_beats_contiguous_on_few_groups_per_rank():
    # Group sizes in sorted order alternate big/small so badly that contiguous runs cannot balance 2 groups per rank.
    rng = random.Random(5)
    seqs, groups = [], []
    for g, plen in enumerate([400, 390, 380, 370, 40, 30, 20, 10]):
        prompt = [g] + [rng.randrange(100) for _ in range(plen)]
        for _ in range(4):
            seqs.append(prompt + [rng.randrange(100) for _ in range(20)])
            groups.append(g)
    contiguous = partition(seqs, 4, group_ids=groups, strategy="contiguous")
    best = partition(seqs, 4, group_ids=groups)
    assert best.max_cost < 0.8 * contiguous.max_cost
    assert best.imbalance < 1.05


def test_grpo_groups_are_not_split():
    rng = random.Random(0)
    seqs, groups = [], []
    for g in range(6):
        prompt = [rng.randrange(50) for _ in range(rng.randrange(5, 20))]
        for _ in range(4):
            seqs.append(prompt + [rng.randrange(50) for _ in range(rng.randrange(1, 10))])
            groups.append(g)
    result = partition(seqs, 3, group_ids=groups)
    check_is_partition(result, len(seqs), 3)
    for part in result.parts:
        assert part and all(sum(groups[j] == groups[i] for j in part) == 4 for i in part), "a group was split"
    free = partition(seqs, 3, group_ids=groups, keep_groups=False)
    assert free.max_cost <= result.max_cost
