"""`recipes/grpo_vlm.py`, the embedded vision-language run, end to end and shortened: DTA trains the tiny Qwen2-VL on
its counting images, shares each prompt's image tokens across its completions, runs the vision tower once per prompt,
and closes with the JSON summary."""

from __future__ import annotations

import json
import sys

from recipe_helpers import ROOT, run

RECIPE = ROOT / "recipes" / "grpo_vlm.py"


def test_vlm_recipe_run(tmp_path):
    out = tmp_path / "vlm"
    result = run([sys.executable, str(RECIPE), "--max_steps", "3", "--vlm_num_rows", "32", "--output_dir", str(out)])
    last = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else ""
    assert last.startswith("summary: "), result.stdout[-2000:] + result.stderr[-3000:]
    record = json.loads(last[len("summary: "):])
    assert record["steps"] == 3 and 0.0 <= record["reward_last"] <= 1.0
    # 4 prompts x 8 completions of <= 4 tokens after a 74-token prompt (36 image tokens): the tree holds ~1/6.
    assert 4.0 < record["compression_ratio"] < 9.0
    assert record["images"] == 4.0 and record["image_rows"] == 32.0
    assert "vision tower on 4.0 distinct images per step instead of 32.0" in result.stdout
    assert (out / "initial_model" / "config.json").is_file() and (out / "model.safetensors").is_file()
