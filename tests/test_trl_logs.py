"""`trl-dta analyze` on TRL's own completion logs (`analysis/trl_logs.py`): the parquet files a real
`GRPOTrainer(log_completions=True)` run writes, read back into the token ids the run trained on, one batch per step;
and the warning of an input whose batches are unknown.

The run is a `DTAGRPOTrainer`, so that it logs its own compression (`dta/tokens`, `dta/tree_tokens`,
`dta/compression_ratio`: each optimizer step's forest) beside TRL's completion logs, and the analyzer's estimate must
equal it. TRL logs completions as text decoded without special tokens, so the run suppresses them in generation
(`<pad>`, `<bos>`, `<eos>`): then the log holds every token the run trained on (`trl_logs.py` says what else a log
cannot give back).
"""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace

import pandas as pd
import pytest
from trl import GRPOTrainer

from test_rollout_io import SEQS, write_jsonl
from trl_dta.analysis import AnalysisError, SourceOptions, analyze_source, load_trl_completions
from trl_dta.cli import main
from trl_dta.demos import tiny
from trl_dta.envs.core.chat import build_chat_tokenizer

STEPS = 2
ROWS_PER_STEP = 8  # 2 prompts x 4 completions: per_device_train_batch_size 4 x gradient_accumulation_steps 2


@pytest.fixture(scope="module")
def trl_run(tmp_path_factory):
    """A 2-step `DTAGRPOTrainer(log_completions=True)` run of the tiny model: `(output_dir, model_dir, log_history)`."""
    from trl_dta import DTAGRPOConfig, DTAGRPOTrainer

    root = tmp_path_factory.mktemp("trl_logs")
    model_dir = tiny.build_default_model_dir(root / "model")
    specials = [tiny.SPECIAL_TOKENS.index(t) for t in tiny.SPECIAL_TOKENS]
    args = DTAGRPOConfig(
        output_dir=str(root / "out"), per_device_train_batch_size=4, gradient_accumulation_steps=2,
        num_generations=4, max_completion_length=4, max_steps=STEPS, logging_steps=1, log_completions=True,
        generation_kwargs={"suppress_tokens": specials}, learning_rate=0.05, optim="sgd", report_to="none",
        use_cpu=True, bf16=False, gradient_checkpointing=False, save_strategy="no", seed=0, disable_tqdm=True,
    )
    trainer = DTAGRPOTrainer(model=str(model_dir), reward_funcs=tiny.arithmetic_reward, args=args,
                             train_dataset=tiny.build_dataset(16, num_shots=2), processing_class=tiny.build_tokenizer())
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "dta/compression_ratio" in entry]
    return root / "out", model_dir, logs


def test_the_analyzer_reads_a_real_runs_logs_step_by_step(trl_run, capsys):
    out, model_dir, logs = trl_run
    files = sorted((out / "completions").glob("*.parquet"))
    assert [f.name for f in files] == ["completions_00001.parquet", "completions_00002.parquet"]
    # the output folder, the completions/ folder and the files: the same rows, one batch per TRL step
    for source in (out, out / "completions"):
        assert main(["analyze", str(source), "--tokenizer", str(model_dir), "--json"]) == 0
        captured = capsys.readouterr()
        result = json.loads(captured.out)
        assert "warning" not in captured.err, captured.err
        assert result["batches"] == STEPS and result["batches_known"]
        assert [b["step"] for b in result["per_batch"]] == [1, 2]
        assert [b["sequences"] for b in result["per_batch"]] == [ROWS_PER_STEP] * STEPS
        # the estimate is the compression the run logged, step by step, and its mean over steps
        assert len(logs) == STEPS
        for batch, logged in zip(result["per_batch"], logs):
            assert batch["tokens"] == logged["dta/tokens"]
            assert batch["tree_tokens"] == logged["dta/tree_tokens"]
            assert batch["compression_ratio"] == logged["dta/compression_ratio"]
        assert result["mean_batch_compression"] == pytest.approx(sum(e["dta/compression_ratio"] for e in logs) / STEPS)
    assert main(["analyze", str(files[1]), "--tokenizer", str(model_dir), "--json"]) == 0
    one = json.loads(capsys.readouterr().out)
    assert one["per_batch"][0]["compression_ratio"] == logs[1]["dta/compression_ratio"]
    # the table lists the steps
    assert main(["analyze", str(out), "--tokenizer", str(model_dir)]) == 0
    table = capsys.readouterr().out
    assert "compression per step: mean (min / max)" in table and "  step 2" in table, table


def test_trl_logs_refusals(trl_run, capsys, monkeypatch):
    out, model_dir, _ = trl_run
    assert main(["analyze", str(out)]) == 2
    assert "pass --tokenizer" in capsys.readouterr().err
    assert main(["analyze", str(out), "--tokenizer", str(model_dir), "--batch-size", "4"]) == 2
    assert "drop `batch_size` (--batch-size)" in capsys.readouterr().err
    # no pyarrow: an error naming it (pyarrow comes with `datasets`, so its absence is simulated)
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    assert main(["analyze", str(out), "--tokenizer", str(model_dir)]) == 2
    assert "needs pyarrow: pip install pyarrow" in capsys.readouterr().err


def test_conversational_prompts_go_through_the_chat_template(tmp_path):
    """A log as TRL writes it for conversational prompts (`prompt`: messages, `completion`: one assistant message):
    the prompt rendered by the chat template with the generation prompt, the completion's text appended."""
    tok = build_chat_tokenizer()
    tok.save_pretrained(tmp_path / "tok")
    prompts = [[{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+3?"}],
               [{"role": "user", "content": "hi"}]]
    completions = ["5", "6", "hello", "hey"]
    table = {"step": [3, 3, 3, 3], "prompt": [prompts[0], prompts[0], prompts[1], prompts[1]],
             "completion": [[{"role": "assistant", "content": c}] for c in completions],
             "reward": [1.0, 0.0, 0.5, 0.5], "advantage": [0.5, -0.5, 0.0, 0.0]}
    (tmp_path / "completions").mkdir()
    pd.DataFrame(table).to_parquet(tmp_path / "completions" / "completions_00003.parquet")
    seqs, groups, steps = load_trl_completions(tmp_path, str(tmp_path / "tok"))
    # the prompts' ids from TRL's own tokenization (TRL 1.16's `GRPOTrainer._tokenize_prompts`, no tools)
    trainer = SimpleNamespace(processing_class=tok, _is_vlm=False, environment_factories=None, tools=None,
                              chat_template=None, chat_template_kwargs={})
    prompt_ids, _, _ = GRPOTrainer._tokenize_prompts(trainer, table["prompt"])
    expected = [list(p) + tok(c, add_special_tokens=False)["input_ids"] for p, c in zip(prompt_ids, completions)]
    assert seqs == expected and groups == [0, 0, 1, 1] and steps == [3] * 4
    # a tool-calling completion (several messages) cannot be rebuilt
    table["completion"][0] = [{"role": "assistant", "content": "x"}, {"role": "tool", "content": "y"}]
    pd.DataFrame(table).to_parquet(tmp_path / "completions" / "completions_00003.parquet")
    with pytest.raises(AnalysisError, match="tool-calling completion"):
        load_trl_completions(tmp_path, str(tmp_path / "tok"))


def test_unknown_batches_warn_naming_batch_size(tmp_path, capsys):
    src = write_jsonl(tmp_path / "r.jsonl", [{"input_ids": s} for s in SEQS])
    assert main(["analyze", src]) == 0
    captured = capsys.readouterr()
    assert "warning: the batches are unknown" in captured.err and "--batch-size" in captured.err
    assert "compression ratio (all rows as one batch)" in captured.out
    assert main(["analyze", src, "--batch-size", "4"]) == 0
    captured = capsys.readouterr()
    assert "warning" not in captured.err and "compression per batch: mean (min / max)" in captured.out
    analysis = analyze_source(src, SourceOptions())
    assert len(analysis.warnings) == 1 and "--batch-size" in analysis.warnings[0]
    assert not analyze_source(src, SourceOptions(), batch_size=8).warnings
