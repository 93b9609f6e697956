"""`trl-dta analyze`: input formats, the numbers it prints, per-rank balance, and errors on malformed input."""

import json
import subprocess
import sys

import pytest

from trl_dta.cli import AnalysisError, analyze, load_sequences, main
from trl_dta.flops import ideal_ratio
from trl_dta.tree import PrefixTree


PROMPTS = [[5, 6, 7, 8, 9, 10], [11, 12, 13, 14]]
COMPLETIONS = [[20 + g, 30, 31] for g in range(4)]
SEQS = [p + c for p in PROMPTS for c in COMPLETIONS]


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _run_json(argv, capsys):
    assert main(argv + ["--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_input_ids_jsonl(tmp_path, capsys):
    src = _write_jsonl(tmp_path / "r.jsonl", [{"input_ids": s, "reward": 1.0} for s in SEQS])
    result = _run_json(["analyze", src, "--model-shape", "qwen2-0.5b"], capsys)
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
    src = _write_jsonl(tmp_path / "r.jsonl", rows)
    auto = _run_json(["analyze", src], capsys)
    explicit = _run_json(["analyze", src, "--prompt-field", "prompt_ids", "--completion-field", "completion_ids"],
                         capsys)
    assert auto["tree_tokens"] == explicit["tree_tokens"] == PrefixTree.from_sequences(SEQS).n_tree_tokens
    # a custom single field
    src2 = _write_jsonl(tmp_path / "f.jsonl", [{"ids": s} for s in SEQS])
    assert _run_json(["analyze", src2, "--field", "ids"], capsys)["tree_tokens"] == auto["tree_tokens"]


def test_batches_split_sharing(tmp_path, capsys):
    src = _write_jsonl(tmp_path / "r.jsonl", [{"input_ids": s} for s in SEQS])
    per_batch = _run_json(["analyze", src, "--batch-size", "2"], capsys)
    expected = sum(PrefixTree.from_sequences(SEQS[i : i + 2]).n_tree_tokens for i in range(0, 8, 2))
    assert per_batch["batches"] == 4
    assert per_batch["tree_tokens"] == expected
    assert per_batch["compression_ratio"] < _run_json(["analyze", src], capsys)["compression_ratio"]


def test_text_with_tokenizer(tmp_path, capsys):
    from trl_dta.tiny import build_tokenizer

    tok = build_tokenizer()
    tok.save_pretrained(tmp_path / "tok")
    texts = ["1+2=3\n4+5=" + a for a in ("9", "8", "10")]
    src = _write_jsonl(tmp_path / "t.jsonl", [{"text": t} for t in texts])
    result = _run_json(["analyze", src, "--tokenizer", str(tmp_path / "tok")], capsys)
    ids = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    assert result["tree_tokens"] == PrefixTree.from_sequences(ids).n_tree_tokens
    assert result["compression_ratio"] > 1.5
    # prompt + completion text
    src2 = _write_jsonl(tmp_path / "pc.jsonl", [{"prompt": "1+2=3\n4+5=", "completion": a} for a in ("9", "8", "10")])
    assert _run_json(["analyze", src2, "--tokenizer", str(tmp_path / "tok")], capsys)["tokens"] == result["tokens"]


def test_saved_dataset(tmp_path, capsys):
    import datasets

    ds = datasets.Dataset.from_dict({"input_ids": SEQS, "prompt_idx": [0] * 4 + [1] * 4})
    ds.save_to_disk(str(tmp_path / "ds"))
    result = _run_json(["analyze", str(tmp_path / "ds")], capsys)
    assert result["tree_tokens"] == PrefixTree.from_sequences(SEQS).n_tree_tokens
    datasets.DatasetDict({"train": ds, "test": ds.select(range(2))}).save_to_disk(str(tmp_path / "dd"))
    assert _run_json(["analyze", str(tmp_path / "dd"), "--split", "test"], capsys)["sequences"] == 2
    assert main(["analyze", str(tmp_path / "dd")]) == 2
    assert "--split" in capsys.readouterr().err


def test_num_processes_balance(tmp_path, capsys):
    pytest.importorskip("trl_dta.balance")
    src = _write_jsonl(tmp_path / "r.jsonl", [{"input_ids": s, "prompt_idx": i // 4} for i, s in enumerate(SEQS)])
    result = _run_json(["analyze", src, "--num-processes", "2", "--group-field", "prompt_idx"], capsys)
    bal = result["balance"]
    assert bal is not None
    # groups kept whole: each rank holds one prompt's group, so all sharing survives
    assert bal["compression_kept"] == pytest.approx(1.0)
    assert 0.5 <= bal["max_share"] < 1.0
    assert bal["imbalance"] >= 1.0
    assert main(["analyze", src, "--num-processes", "2"]) == 0
    assert "per-rank balance (2 processes)" in capsys.readouterr().out


@pytest.mark.parametrize(
    "lines,args,message",
    [
        (['{"input_ids": [1, 2]}', '{"input_ids": [1, 3]}', "{not json"], [], "line 3: invalid JSON"),
        (['{"input_ids": [1, 2]}', '{"ids": [1, 3]}'], [], "line 2: no token ids"),
        (['{"input_ids": [1, 2]}', '{"input_ids": [1, "a"]}'], [], "line 2, field 'input_ids': token ids"),
        (['{"input_ids": [1, -2]}'], [], "line 1, field 'input_ids': token ids must be non-negative"),
        (['{"input_ids": "1 2"}'], [], "line 1, field 'input_ids': expected a list"),
        (['{"ids": [1, 2]}', '{"x": 1}'], ["--field", "ids"], "line 2: missing field 'ids'"),
        (['{"text": "abc"}'], [], "pass --tokenizer"),
        (['[1, 2, 3]'], [], "line 1: expected a JSON object"),
        (['{"prompt_ids": [1]}'], ["--prompt-field", "prompt_ids"], "go together"),
        (['{"input_ids": [1, 2]}'], ["--batch-size", "0"], "--batch-size must be >= 1"),
        (['{"input_ids": [1, 2]}'], ["--model-shape", "gpt-9"], "unknown --model-shape"),
        (['{"input_ids": [1, 2]}'], ["--text-field", "t"], "--text-field needs --tokenizer"),
        (['{"input_ids": [1, 2]}'], ["--group-field", "g", "--num-processes", "2"], "missing group field 'g'"),
        ([], [], "no rows"),
    ],
)
def test_malformed_input(tmp_path, capsys, lines, args, message):
    src = tmp_path / "bad.jsonl"
    src.write_text("\n".join(lines) + ("\n" if lines else ""))
    assert main(["analyze", str(src)] + args) == 2
    err = capsys.readouterr().err
    assert message in err, err


def test_missing_file(capsys):
    assert main(["analyze", "/nonexistent/rollouts.jsonl"]) == 2
    assert "no such file" in capsys.readouterr().err


def test_library_api_errors():
    with pytest.raises(AnalysisError, match="fraction-of-ideal"):
        analyze(SEQS, fraction_of_ideal=1.5)
    with pytest.raises(AnalysisError, match="num-processes"):
        analyze(SEQS, num_processes=0)


def test_load_sequences_with_groups(tmp_path):
    src = _write_jsonl(tmp_path / "r.jsonl", [{"input_ids": s, "g": i // 4} for i, s in enumerate(SEQS)])
    seqs, groups = load_sequences(src, group_field="g")
    assert seqs == SEQS
    assert groups == [0] * 4 + [1] * 4
    assert load_sequences(src)[1] is None


def test_console_entry_point(tmp_path):
    src = _write_jsonl(tmp_path / "r.jsonl", [{"input_ids": s} for s in SEQS])
    out = subprocess.run([sys.executable, "-m", "trl_dta.cli", "analyze", src], capture_output=True, text=True,
                         check=True)
    assert "compression ratio" in out.stdout
