"""GRPO on images with Dynamic Tree Attention: `DTAGRPOTrainer` on a vision-language model.

It trains the embedded vision-language setup, built locally with no network (`trl_dta.demos.tiny_vlm`): a tiny Qwen2-VL
with random weights (a 2-layer, 64-wide text model with M-RoPE and a 2-block vision tower), its processor (Qwen2-VL's,
over a character-level tokenizer, with transformers' PIL image processor), and a shape-counting task: each 48x48 image
shows 1 to 4 squares, the question asks how many, and the reward scores the number answered against the count. A prompt
is 74 tokens, 36 of them the image's; all 8 completions of a prompt share them, so DTA forwards each prompt (image
included) once, runs the vision tower once per prompt instead of once per completion, and back-propagates the summed
gradients through both once.

The run ends with the summary of `recipes/grpo.py` (reward trend, step split, compression with the image tokens), a
line on the vision tower's savings, and one line `summary: {...}` (JSON, with `images` and `image_rows` per step).

Launch:

```bash
python recipes/grpo_vlm.py                                   # the embedded VLM (CPU, about a minute)
python recipes/grpo_vlm.py --dta_enabled false               # TRL's dense path, for comparison
python recipes/grpo_vlm.py --config recipes/configs/vlm.yaml --use_peft true --lora_target_modules all-linear \
    --lora_dropout 0.0                                       # LoRA on every linear layer, the tower's included
# Two processes on CPU (DDP over gloo; runs, its equivalence with TRL is not tested with images)
accelerate launch --config_file recipes/configs/accelerate_multi_cpu.yaml recipes/grpo_vlm.py --use_cpu true
```
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from trl import ModelConfig, TrlParser, get_peft_config

from trl_dta import DTAGRPOConfig, DTAGRPOTrainer
from trl_dta.analysis.run_summary import mean_of
from trl_dta.demos import tiny_vlm
from trl_dta.trainers.console import RunArguments, modern_flags, quiet_console, use_console

sys.path.insert(0, str(Path(__file__).resolve().parent))
from grpo_summary import summarize, summary_record  # noqa: E402 (the text recipe's summary, beside this script)

DEFAULT_CONFIG = Path(__file__).resolve().parent / "configs" / "vlm.yaml"


@dataclass
class VLMScriptArguments(RunArguments):
    """
    Script arguments of the VLM recipe: the run options of the recipes ([`~trl_dta.trainers.console.RunArguments`])
    and the embedded setup's sizes.

    Args:
        vlm_num_rows (`int`, *optional*, defaults to `1024`):
            Rows of the shape-counting dataset.
        vlm_max_count (`int`, *optional*, defaults to `4`):
            Most squares in an image.
        vlm_image_size (`int`, *optional*, defaults to `48`):
            Pixels per image side (a multiple of 8; 48 gives 36 image tokens).
        vlm_hidden_size (`int`, *optional*, defaults to `64`):
            Width of the text model.
        vlm_num_hidden_layers (`int`, *optional*, defaults to `2`):
            Depth of the text model.
    """

    vlm_num_rows: int = field(default=1024, metadata={"help": "Rows of the shape-counting dataset."})
    vlm_max_count: int = field(default=4, metadata={"help": "Most squares in an image."})
    vlm_image_size: int = field(
        default=48, metadata={"help": "Pixels per image side (a multiple of 8; 48 gives 36 image tokens)."}
    )
    vlm_hidden_size: int = field(default=64, metadata={"help": "Width of the text model."})
    vlm_num_hidden_layers: int = field(default=2, metadata={"help": "Depth of the text model."})


def vision_line(log_history: list[dict]) -> str:
    """The summary's line on the vision tower: distinct images encoded per step against the images the rows show
    (what TRL's dense path encodes), or why there is none."""
    images, rows = mean_of(log_history, "dta/images"), mean_of(log_history, "dta/image_rows")
    if images is None or rows is None:
        return "DTA: no image metrics logged (DTA disabled, or every micro-batch ran TRL's dense path)"
    return (f"DTA: vision tower on {images:.1f} distinct images per step instead of {rows:.1f} "
            f"(TRL's dense path encodes every row's image: {rows / images:.1f}x)")


def main(script_args: VLMScriptArguments, training_args: DTAGRPOConfig, model_args: ModelConfig) -> DTAGRPOTrainer:
    """Builds the model folder, processor, data and trainer, trains, saves, prints the summary; returns the trainer."""
    from accelerate import PartialState

    script_args.check_run_args()
    script_args.set_threads()
    model_dir = Path(training_args.output_dir) / "initial_model"
    with PartialState().local_main_process_first():  # TRL reloads the reference model from the folder (beta > 0)
        if PartialState().is_local_main_process:
            tiny_vlm.build_model_dir(model_dir, hidden_size=script_args.vlm_hidden_size,
                                     num_hidden_layers=script_args.vlm_num_hidden_layers, seed=training_args.seed)
    processor = tiny_vlm.build_processor(script_args.vlm_image_size)
    dataset = tiny_vlm.build_dataset(script_args.vlm_num_rows, max_count=script_args.vlm_max_count,
                                     image_size=script_args.vlm_image_size, seed=training_args.seed)
    trainer = DTAGRPOTrainer(model=str(model_dir), reward_funcs=tiny_vlm.count_reward, args=training_args,
                             train_dataset=dataset, processing_class=processor, peft_config=get_peft_config(model_args))
    use_console(trainer, script_args.console_steps)
    start = time.perf_counter()
    trainer.train()
    wall_time = time.perf_counter() - start

    trainer.save_model(training_args.output_dir)
    history, steps = trainer.state.log_history, trainer.state.global_step
    text = summarize(history, steps, wall_time, script_args.summary_window, trainer.accelerator.num_processes)
    trainer.accelerator.print(text.replace("trl-dta GRPO summary", "trl-dta GRPO VLM summary"))
    trainer.accelerator.print(vision_line(history))
    record = summary_record(history, steps, wall_time, script_args.summary_window, trainer.accelerator.num_processes)
    record.update(images=mean_of(history, "dta/images"), image_rows=mean_of(history, "dta/image_rows"))
    trainer.accelerator.print("summary: " + json.dumps(record))
    trainer.accelerator.wait_for_everyone()
    trainer.end()
    return trainer


def parse_args(argv: list[str] | None = None):
    """Parses the command line; without `--config`, `configs/vlm.yaml` applies."""
    argv = modern_flags(list(sys.argv[1:] if argv is None else argv))
    if "--config" not in {arg.split("=", 1)[0] for arg in argv}:
        argv = ["--config", str(DEFAULT_CONFIG), *argv]
    return TrlParser((VLMScriptArguments, DTAGRPOConfig, ModelConfig)).parse_args_and_config(argv)


if __name__ == "__main__":
    quiet_console()
    trainer = main(*parse_args())
    if trainer.accelerator.num_processes > 1:  # as `recipes/grpo.py`: leave before the gloo group's destructor can hang
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
