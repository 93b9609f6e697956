"""`trl-dta analyze`: input formats, the numbers it prints, per-rank balance, and errors on malformed input."""

import random
import subprocess
import sys

import numpy as np
import pytest
import torch

from test_rollout_io import COMPLETIONS, GROUPS, PROMPTS, SEQS, run_json, write_jsonl
from trl_dta.analysis import AnalysisError, analyze, load_sequences
from trl_dta.balance import CostModel, partition_for_ranks
from trl_dta.cli import main
from trl_dta.flops import get_model_shape, ideal_ratio
from trl_dta.memory import ATTN_BACKENDS, peak_memory
from trl_dta.tree import PrefixTree


def test_input_ids_jsonl(tmp_path, capsys):
    src = write_jsonl(tmp_path / "r.jsonl", [{"input_ids": s, "reward": 1.0} for s in SEQS])
    result = run_json(["analyze", src, "--model-shape", "qwen2-0.5b"], capsys)
    tree = PrefixTree.from_sequences(SEQS)
    assert result["sequences"] == 8
    assert result["tokens"] == tree.n_tokens == 4 * 9 + 4 * 7
    assert result["tree_tokens"] == tree.n_tree_tokens == 6 + 4 + 8 * 3
    assert result["compression_ratio"] == pytest.approx(tree.compression_ratio)
    assert result["ideal_speedup"] == pytest.approx(ideal_ratio(tree, "qwen2-0.5b"))
    assert result["predicted_speedup"] == pytest.approx(result["ideal_speedup"] * result["fraction_of_ideal"])
    # no sharing: the trainers fall back to the dense path, so no slow-down is predicted
    plain = analyze([[i, 5, 6, 7] for i in range(4)], fraction_of_ideal=0.5)
    assert plain["ideal_speedup"] == pytest.approx(1.0)
    assert plain["predicted_speedup"] == 1.0
    assert result["max_segments_depth"] == 2
    assert result["balance"] is None

    assert main(["analyze", src]) == 0
    table = capsys.readouterr().out
    for label in ("sequences", "tree tokens", "compression ratio", "ideal FLOP speed-up (qwen3-1.7b)",
                  "predicted DTA speed-up"):
        assert label in table
    assert f"{tree.compression_ratio:.2f}x" in table


def test_prompt_and_completion_fields(tmp_path, capsys):
    rows = [{"prompt_ids": p, "completion_ids": c} for p in PROMPTS for c in COMPLETIONS]
    src = write_jsonl(tmp_path / "r.jsonl", rows)
    auto = run_json(["analyze", src], capsys)
    explicit = run_json(["analyze", src, "--prompt-field", "prompt_ids", "--completion-field", "completion_ids"],
                         capsys)
    assert auto["tree_tokens"] == explicit["tree_tokens"] == PrefixTree.from_sequences(SEQS).n_tree_tokens
    # a custom single field
    src2 = write_jsonl(tmp_path / "f.jsonl", [{"ids": s} for s in SEQS])
    assert run_json(["analyze", src2, "--field", "ids"], capsys)["tree_tokens"] == auto["tree_tokens"]


def test_batches_split_sharing(tmp_path, capsys):
    src = write_jsonl(tmp_path / "r.jsonl", [{"input_ids": s} for s in SEQS])
    per_batch = run_json(["analyze", src, "--batch-size", "2"], capsys)
    expected = sum(PrefixTree.from_sequences(SEQS[i : i + 2]).n_tree_tokens for i in range(0, 8, 2))
    assert per_batch["batches"] == 4
    assert per_batch["tree_tokens"] == expected
    assert per_batch["compression_ratio"] < run_json(["analyze", src], capsys)["compression_ratio"]


def test_num_processes_balance(tmp_path, capsys):
    src = write_jsonl(tmp_path / "r.jsonl", [{"input_ids": s, "prompt_idx": i // 4} for i, s in enumerate(SEQS)])
    result = run_json(["analyze", src, "--num-processes", "2", "--group-field", "prompt_idx"], capsys)
    bal = result["balance"]
    assert bal is not None and bal["whole_groups"]
    # groups kept whole: each rank holds one prompt's group, so all sharing survives
    assert bal["compression_kept"] == pytest.approx(1.0)
    assert 0.5 <= bal["max_share"] < 1.0
    assert bal["imbalance"] >= 1.0
    assert main(["analyze", src, "--num-processes", "2"]) == 0
    assert "per-rank balance (2 processes, single rows)" in capsys.readouterr().out


def _expected_balance(seqs, groups, k, batch_size, shape):
    """The analyzer's balance row recomputed from `partition_for_ranks`, batch by batch."""
    model = CostModel(hidden_size=get_model_shape(shape).hidden_size)
    parts = [
        partition_for_ranks(seqs[i : i + batch_size], k, cost_model=model,
                            group_ids=None if groups is None else groups[i : i + batch_size])
        for i in range(0, len(seqs), batch_size)
    ]
    return {
        "imbalance": sum(p.imbalance for p in parts) / len(parts),
        "worst_imbalance": max(p.imbalance for p in parts),
        "max_share": sum(p.max_cost / sum(p.costs) for p in parts) / len(parts),
        "compression_kept": sum(p.compression_kept for p in parts) / len(parts),
        "whole_groups": groups is not None,
        "hidden_size": model.hidden_size,
    }


@pytest.mark.parametrize("shape", ["qwen3-1.7b", "bench-cpu-quick"])
@pytest.mark.parametrize(("k", "batch_size", "grouped"), [(2, 16, True), (4, 16, True), (2, 8, False), (4, 32, False)])
def test_balance_prediction_is_the_trainers_partition(shape, k, batch_size, grouped):
    # 8 prompts x 4 completions of uneven lengths: the prediction must be exactly what the trainers' split gives, with
    # the cost model of the chosen model's width.
    rng = random.Random(k * 100 + batch_size)
    seqs, groups = [], []
    for g in range(8):
        prompt = [g] + [rng.randrange(50) for _ in range(rng.randrange(5, 60))]
        for _ in range(4):
            seqs.append(prompt + [rng.randrange(50) for _ in range(rng.randrange(1, 30))])
            groups.append(g)
    group_ids = groups if grouped else None
    result = analyze(seqs, shape, batch_size=batch_size, num_processes=k, groups=group_ids)
    assert result["balance"] == _expected_balance(seqs, group_ids, k, batch_size, shape)


def test_prompt_completion_input_groups_by_prompt(tmp_path, capsys):
    rows = [{"prompt_ids": p, "completion_ids": c} for p in PROMPTS for c in COMPLETIONS]
    src = write_jsonl(tmp_path / "r.jsonl", rows)
    seqs, groups = load_sequences(src)
    assert groups == [0] * 4 + [1] * 4
    result = run_json(["analyze", src, "--num-processes", "2", "--model-shape", "qwen2-0.5b"], capsys)
    assert result["balance"] == _expected_balance(SEQS, groups, 2, 8, "qwen2-0.5b")
    assert result["balance"]["whole_groups"] and result["balance"]["compression_kept"] == pytest.approx(1.0)
    single = run_json(["analyze", src, "--num-processes", "2", "--model-shape", "qwen2-0.5b", "--no-groups"], capsys)
    assert single["balance"] == _expected_balance(SEQS, None, 2, 8, "qwen2-0.5b")


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"seqs": []}, AnalysisError, "`seqs` is empty"),
        ({"seqs": "abc"}, TypeError, "`seqs` must be an ordered iterable"),
        ({"seqs": 5}, TypeError, "`seqs` must be an ordered iterable"),
        ({"seqs": torch.ones(2, 3, dtype=torch.long)}, TypeError, "from_padded"),
        ({"seqs": [[1, 2.0]]}, TypeError, r"`seqs\[0\]\[1\]` must be an integer token id"),
        ({"seqs": [[1, True]]}, TypeError, r"`seqs\[0\]\[1\]` must be an integer token id"),
        ({"seqs": [torch.tensor([1.0, 2.0])]}, TypeError, r"`seqs\[0\]` must hold integer token ids"),
        ({"seqs": SEQS + [[1, -2]], "batch_size": 3}, ValueError,
         r"`seqs\[2\]` has a negative token id \(-2\); .* \(batch 2: `seqs\[6:9\]`; the index counts from the batch"),
        ({"model_shape": "gpt-9"}, AnalysisError, r"unknown `model_shape` \(--model-shape\) 'gpt-9'"),
        ({"model_shape": 5}, TypeError, "`model_shape` must be a name in"),
        ({"model_shape": None}, TypeError, "`model_shape` must be a name in"),
        ({"batch_size": 0}, ValueError, "`batch_size` must be None or a positive integer"),
        ({"batch_size": True}, TypeError, "`batch_size` must be None or a positive integer"),
        ({"batch_size": 4.0}, TypeError, "`batch_size` must be None or a positive integer"),
        ({"batch_size": "4"}, TypeError, "`batch_size` must be None or a positive integer"),
        ({"num_processes": 0}, ValueError, "`num_processes` must be None or a positive integer"),
        ({"num_processes": -2}, ValueError, "`num_processes` must be None or a positive integer"),
        ({"num_processes": True}, TypeError, "`num_processes` must be None or a positive integer"),
        ({"num_processes": 2.0}, TypeError, "`num_processes` must be None or a positive integer"),
        ({"num_processes": 3}, AnalysisError, r"8 sequences, not a multiple of `num_processes` \(--num-processes\)"),
        ({"num_processes": 2, "batch_size": 3}, AnalysisError, "batch 0 has 3 sequences"),
        ({"num_processes": 3, "batch_size": 6}, AnalysisError, "batch 1 has 2 sequences"),
        ({"num_processes": 2, "groups": [0, 0, 0, 1, 1, 1, 1, 1]}, AnalysisError, "cannot be dealt out whole"),
        ({"num_processes": 4, "groups": [0] * 4 + [1] * 4}, AnalysisError, "cannot be dealt out whole"),
        ({"groups": [0, 1]}, ValueError, "`groups` must give one group id per sequence: got 2 ids for 8"),
        ({"groups": [[0]] * 8}, TypeError, r"`groups\[0\]` must be an integer or a string"),
        ({"groups": [0.0] * 8}, TypeError, r"`groups\[0\]` must be an integer or a string"),
        ({"groups": torch.zeros(8)}, TypeError, "`groups` must be 1-D with integer or string labels"),
        ({"fraction_of_ideal": 0}, ValueError, "`fraction_of_ideal` must be a finite number > 0"),
        ({"fraction_of_ideal": -0.5}, ValueError, "`fraction_of_ideal` must be a finite number > 0"),
        ({"fraction_of_ideal": float("nan")}, ValueError, "`fraction_of_ideal` must be a finite number > 0"),
        ({"fraction_of_ideal": float("inf")}, ValueError, "`fraction_of_ideal` must be a finite number > 0"),
        ({"fraction_of_ideal": "0.8"}, TypeError, "`fraction_of_ideal` must be a finite number > 0"),
        ({"fraction_of_ideal": True}, TypeError, "`fraction_of_ideal` must be a finite number > 0"),
    ],
)
def test_library_api_errors(kwargs, error, match):
    kwargs = {"seqs": SEQS, **kwargs}
    with pytest.raises(error, match=match):
        analyze(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "same_as"),
    [
        ({"seqs": (s for s in SEQS)}, {}),
        ({"seqs": [torch.tensor(s) for s in SEQS]}, {}),
        ({"model_shape": "QWEN2-0.5B"}, {"model_shape": "qwen2-0.5b"}),
        ({"model_shape": get_model_shape("qwen2-0.5b")}, {"model_shape": "qwen2-0.5b"}),
        ({"num_processes": 2, "groups": torch.tensor(GROUPS)}, {"num_processes": 2, "groups": GROUPS}),
        ({"num_processes": 2, "groups": ["a"] * 4 + ["b"] * 4}, {"num_processes": 2, "groups": GROUPS}),
        ({"num_processes": np.int64(2), "batch_size": np.int32(4)}, {"num_processes": 2, "batch_size": 4}),
    ],
)
def test_library_api_equivalent_inputs(kwargs, same_as):
    assert analyze(**{"seqs": SEQS, **kwargs}) == analyze(**{"seqs": SEQS, **same_as})


def test_fraction_of_ideal_above_one():
    # benchmarks/RESULTS.md measures fractions above 1 on CPU: a user may pass what they measure.
    result = analyze(SEQS, fraction_of_ideal=1.1)
    assert result["predicted_speedup"] == pytest.approx(max(result["ideal_speedup"] * 1.1, 1.0))


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--num-processes", "0"], "argument --num-processes: must be a positive integer, got 0"),
        (["--num-processes", "2.5"], "argument --num-processes: must be a positive integer, got '2.5'"),
        (["--num-processes", "two"], "argument --num-processes: must be a positive integer, got 'two'"),
        (["--batch-size", "-3"], "argument --batch-size: must be a positive integer, got -3"),
        (["--fraction-of-ideal", "nan"], "argument --fraction-of-ideal: must be a finite number > 0, got 'nan'"),
        (["--fraction-of-ideal", "0"], "argument --fraction-of-ideal: must be a finite number > 0, got '0'"),
        (["--fraction-of-ideal", "x"], "argument --fraction-of-ideal: must be a finite number > 0, got 'x'"),
        (["--num-processes", "3"], "8 sequences, not a multiple of `num_processes` (--num-processes) = 3"),
        (["--num-processes", "4", "--group-field", "g"], "cannot be dealt out whole"),
        (["--group-field", "bad"], "group field 'bad': a group label must be an integer or a string"),
        (["--group-field", "g", "--no-groups"], "--no-groups and --group-field contradict"),
        (["--bogus"], "unrecognized arguments: --bogus"),
    ],
)
def test_bad_flags_exit_2_with_one_line(tmp_path, capsys, args, message):
    rows = [{"input_ids": s, "g": i // 4, "bad": [i]} for i, s in enumerate(SEQS)]
    src = write_jsonl(tmp_path / "r.jsonl", rows)
    assert main(["analyze", src] + args) == 2
    err = capsys.readouterr().err
    assert message in err, err
    assert err.count("\n") == 1 and err.startswith("trl-dta"), err


def test_help_exits_0(capsys):
    assert main(["analyze", "--help"]) == 0
    assert "benchmarks/RESULTS.md" in capsys.readouterr().out


def test_console_entry_point(tmp_path):
    src = write_jsonl(tmp_path / "r.jsonl", [{"input_ids": s} for s in SEQS])
    out = subprocess.run([sys.executable, "-m", "trl_dta.cli", "analyze", src], capture_output=True, text=True,
                         check=True)
    assert "compression ratio" in out.stdout


def test_model_shape_from_config_path(tmp_path, capsys):
    # A config folder gives the FLOP counts and the balance cost model of that model's width.
    from transformers import Qwen2Config

    config = Qwen2Config(hidden_size=96, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=300)
    config.save_pretrained(tmp_path / "tiny-qwen")
    src = write_jsonl(tmp_path / "r.jsonl", [{"input_ids": s} for s in SEQS])
    result = run_json(["analyze", src, "--model-shape", str(tmp_path / "tiny-qwen"), "--num-processes", "2"], capsys)
    assert result["model_shape"] == "tiny-qwen"
    assert result["balance"] == _expected_balance(SEQS, None, 2, 8, config)
    assert result["balance"]["hidden_size"] == 96


def test_peak_memory_per_backend(tmp_path, capsys):
    # 2 prompts x 4 completions; the estimate is `flops.peak_memory` of the worst batch (or rank), per backend
    src = write_jsonl(tmp_path / "r.jsonl", [{"input_ids": s, "g": i // 4} for i, s in enumerate(SEQS)])
    result = run_json(["analyze", src, "--model-shape", "qwen3-8b", "--dtype", "fp32", "--max-graph-tokens",
                        "none", "--max-batch-tokens", "6"], capsys)
    assert result["dtype"] == "fp32" and list(result["peak_memory"]) == list(ATTN_BACKENDS)
    for backend, m in result["peak_memory"].items():
        expected = peak_memory(SEQS, "qwen3-8b", backend, "fp32", max_batch_tokens=6, max_graph_tokens=None)
        assert m["total"] == expected.total and m["prefix_copies"] == expected.prefix_copies
    assert result["peak_memory"]["sdpa"]["prefix_copies"] > 0 == result["peak_memory"]["flash"]["prefix_copies"]
    # per rank: the worse of the two ranks' forests (one prompt group each)
    result = analyze(SEQS, "qwen3-8b", num_processes=2, groups=GROUPS, max_graph_tokens=None)
    worst = max(peak_memory(SEQS[r * 4 : r * 4 + 4], "qwen3-8b", "sdpa", max_graph_tokens=None).total for r in (0, 1))
    assert result["peak_memory"]["sdpa"]["total"] == worst
    assert main(["analyze", src, "--model-shape", "qwen3-8b"]) == 0
    table = capsys.readouterr().out
    assert "peak memory per step (bf16, worst batch)" in table
    for backend in ATTN_BACKENDS:
        assert f"  {backend} " in table
    with pytest.raises(ValueError, match="unknown `dtype` \\(--dtype\\) 'int8'"):
        analyze(SEQS, dtype="int8")
    with pytest.raises(ValueError, match="`max_graph_tokens` must be"):
        analyze(SEQS, max_graph_tokens=-1)
    assert main(["analyze", src, "--max-graph-tokens", "x"]) == 2
    assert "argument --max-graph-tokens: must be an integer >= 0 or 'none', got 'x'" in capsys.readouterr().err


def _conversations(tasks: int, per_task: int) -> tuple[list[dict], list[list[int]], list[list[list[int]]]]:
    """Rows with `turns` + `roles` (a shared system prompt, a task opening, 2-3 assistant turns each), the episodes
    and their per-turn rows (built here by hand: the conversation up to the end of each assistant turn)."""
    rng = random.Random(tasks * 10 + per_task)
    system = [rng.randrange(3, 90) for _ in range(40)]
    rows, episodes, per_turn = [], [], []
    for task in range(tasks):
        opening = [100 + task] + [rng.randrange(3, 90) for _ in range(8)]
        for _ in range(per_task):
            turns, roles, cuts = [system, opening], ["system", "user"], []
            for _ in range(rng.randint(2, 3)):
                turns += [[rng.randrange(3, 90) for _ in range(rng.randint(3, 12))] for _ in range(2)]
                roles += ["assistant", "tool"]
                cuts.append(sum(map(len, turns[:-1])))
            ids = [t for turn in turns for t in turn]
            rows.append({"turns": turns, "roles": roles, "task": task})
            episodes.append(ids)
            per_turn.append([ids[:cut] for cut in cuts])
    return rows, episodes, per_turn


def test_conversation_layouts(tmp_path, capsys):
    rows, episodes, per_turn = _conversations(2, 3)
    src = write_jsonl(tmp_path / "c.jsonl", rows)
    both = run_json(["analyze", src, "--model-shape", "qwen2-0.5b"], capsys)
    assert list(both) == ["episode", "per_turn"]
    assert both["episode"] == analyze(episodes, "qwen2-0.5b")
    assert both["per_turn"] == analyze(episodes, "qwen2-0.5b", rows=per_turn)
    turn_rows = [row for rows_of in per_turn for row in rows_of]
    tree = PrefixTree.from_sequences(turn_rows)
    assert both["per_turn"]["sequences"] == len(turn_rows) > both["episode"]["sequences"] == 6
    assert (both["per_turn"]["tokens"], both["per_turn"]["tree_tokens"]) == (tree.n_tokens, tree.n_tree_tokens)
    assert both["per_turn"]["ideal_speedup"] == pytest.approx(ideal_ratio(turn_rows, "qwen2-0.5b"))
    # the turns of an episode are nested prefixes: the per-turn layout's tree holds no more than the episodes'
    assert both["per_turn"]["tree_tokens"] <= both["episode"]["tree_tokens"]
    assert both["per_turn"]["compression_ratio"] > both["episode"]["compression_ratio"] > 1
    only = run_json(["analyze", src, "--model-shape", "qwen2-0.5b", "--layout", "per_turn"], capsys)
    assert only == {"per_turn": both["per_turn"]}
    assert main(["analyze", src, "--batch-size", "3"]) == 0
    table = capsys.readouterr().out
    assert "layout: episode (one sequence per conversation)" in table
    assert "layout: per_turn (one sequence per assistant turn)" in table
    assert table.count("compression ratio") == 2


def test_conversation_layouts_per_rank(tmp_path, capsys):
    # Ranks get whole conversations (groups: the task), as the trainers deal out episodes; each rank's per-turn
    # forest is the turns of its own conversations.
    rows, episodes, per_turn = _conversations(4, 2)
    groups = [row["task"] for row in rows]
    src = write_jsonl(tmp_path / "c.jsonl", rows)
    result = run_json(["analyze", src, "--num-processes", "2", "--group-field", "task", "--model-shape", "qwen3-8b",
                       "--max-graph-tokens", "none"], capsys)
    for layout in ("episode", "per_turn"):
        assert result[layout]["balance"] == _expected_balance(episodes, groups, 2, 8, "qwen3-8b")
    model = CostModel(hidden_size=get_model_shape("qwen3-8b").hidden_size)
    parts = partition_for_ranks(episodes, 2, group_ids=groups, cost_model=model).parts
    worst = max(peak_memory([row for j in part for row in per_turn[j]], "qwen3-8b", "sdpa", max_graph_tokens=None).total
                for part in parts)
    assert result["per_turn"]["peak_memory"]["sdpa"]["total"] == worst
    with pytest.raises(ValueError, match="`rows` must be a list with the training rows of each of the 8 sequences"):
        analyze(episodes, rows=per_turn[:3])
    with pytest.raises(AnalysisError, match="`rows` holds no training row"):
        analyze(episodes, rows=[[] for _ in episodes])


def test_hybrid_model_shape_from_config_path(tmp_path, capsys):
    """A hybrid's config folder (Qwen3.5: Gated DeltaNet and attention layers): the predicted speed-up and the memory
    estimate use its layer kinds (`flops.ModelShape` recurrent fields), as the named shape `qwen3.5-9b` does."""
    from transformers import Qwen3_5TextConfig

    config = Qwen3_5TextConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                               num_key_value_heads=2, head_dim=16, vocab_size=300, linear_num_value_heads=4,
                               linear_num_key_heads=2, linear_key_head_dim=16, linear_value_head_dim=16)
    config.save_pretrained(tmp_path / "tiny-qwen3.5")
    src = write_jsonl(tmp_path / "r.jsonl", [{"input_ids": s} for s in SEQS])
    result = run_json(["analyze", src, "--model-shape", str(tmp_path / "tiny-qwen3.5")], capsys)
    shape = get_model_shape(config)
    assert (shape.attention_layers, shape.recurrent_layers, shape.recurrent_kind) == (1, 3, "gated_deltanet")
    assert result["ideal_speedup"] == pytest.approx(ideal_ratio(SEQS, shape))
    assert result["peak_memory"]["torch"]["total"] == peak_memory(SEQS, shape, "torch").total
    assert run_json(["analyze", src, "--model-shape", "qwen3.5-9b"], capsys)["model_shape"] == "qwen3.5-9b"
