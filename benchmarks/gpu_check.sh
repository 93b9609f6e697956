#!/usr/bin/env bash
# GPU check in one script, within about 8 minutes on one large GPU (H100/H200 class):
#   1. environment report (torch, CUDA, transformers, trl);
#   2. engine correctness on the GPU: DTAEngine.forward_backward vs the per-sequence oracle (loss, log-probs,
#      every parameter gradient) in fp32 and bf16 on a small Qwen2/Qwen3-shaped model, plus the CPU engine and
#      baseline tests;
#   3. the full benchmark suite on the GPU (qwen3-1.7b shape, bf16, one round), then the chart.
# Usage (repository root, an environment with torch+CUDA, transformers, trl and this package importable):
#   bash benchmarks/gpu_check.sh            # results in benchmarks/results/full-cuda-bf16.{csv,png,md}
#   OUT=/some/dir bash benchmarks/gpu_check.sh   # also copies the results and logs there
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" TOKENIZERS_PARALLELISM=false
LOG=benchmarks/results/gpu_check.log
mkdir -p benchmarks/results
: > "$LOG"
status=0
step() { echo "=== $* ($(date +%T))" | tee -a "$LOG"; }

step "environment"
python - <<'EOF' 2>&1 | tee -a "$LOG"
import torch, transformers, trl
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
print("transformers", transformers.__version__, "trl", trl.__version__)
assert torch.cuda.is_available(), "no CUDA device"
print(torch.cuda.get_device_name(0), f"{torch.cuda.get_device_properties(0).total_memory / 2**30:.0f} GiB")
EOF
[ "${PIPESTATUS[0]}" -eq 0 ] || { echo "no usable GPU environment" | tee -a "$LOG"; exit 1; }

step "engine correctness on cuda (fp32, bf16)"
timeout 150 python - <<'EOF' 2>&1 | tee -a "$LOG" || status=1
import torch
from benchmarks import common, workloads
from benchmarks.baselines.dense import DenseProvider
from trl_dta import DTAEngine
from trl_dta.flops import ModelShape

def oracle(model, seqs, loss_fn):
    model.zero_grad(set_to_none=True)
    lps = []
    for i, s in enumerate(seqs):
        s = s.cuda()
        logits = model(input_ids=s[None]).logits[0, :-1].float()
        lp = torch.log_softmax(logits, -1).gather(-1, s[1:, None])[:, 0]
        loss_fn(i, lp).backward()
        lps.append(lp.detach())
    g = {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return lps, g

failed = False
for family in ("qwen2", "qwen3"):
    shape = ModelShape(256, 512, 3, 4, 2, 64, 1024, name=f"{family}-check")
    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, None)):
        w = workloads.multi_turn(system_len=300, n_tasks=2, group=4, task_len=20, turns=2, turn_len=40,
                                 distinct=(2, 4), vocab_size=1024)
        model = common.build_model(shape, dtype, "cuda")
        model.config._attn_implementation = "sdpa"
        loss_fn = common.make_loss_fn(len(w.seqs), w.n_tokens)
        ref_lps, ref_g = oracle(model, w.seqs, loss_fn)
        out = DTAEngine(model).forward_backward([s.cuda() for s in w.seqs], loss_fn)
        g = {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}
        model.zero_grad(set_to_none=True)
        lp_err = max(((a.float() - b.float()).abs().max() / b.float().abs().max()).item()
                     for a, b in zip(out.logps, ref_lps))
        g_err = max(((g[n] - ref_g[n]).abs().max() / ref_g[n].abs().max().clamp(min=1e-12)).item() for n in ref_g)
        if tol is None:  # bf16: judge against the dense bf16 path's own error vs the fp32 model
            dense = DenseProvider(common.build_model(shape, dtype, "cuda"), micro_batch_size=4)
            d = dense.forward_backward(w.seqs, loss_fn)
            dg = {n: p.grad.float() for n, p in dense.model.named_parameters() if p.grad is not None}
            d_err = max(((dg[n] - ref_g[n]).abs().max() / ref_g[n].abs().max().clamp(min=1e-12)).item()
                        for n in ref_g)
            tol = max(4 * d_err, 2e-2)
        ok = lp_err <= tol and g_err <= tol
        failed |= not ok
        print(f"{family} {str(dtype):15s} logp rel err {lp_err:.2e}  grad rel err {g_err:.2e}  tol {tol:.1e}  "
              f"{'OK' if ok else 'FAIL'}", flush=True)
raise SystemExit(1 if failed else 0)
EOF
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

step "CPU engine + baseline tests"
timeout 150 python -m pytest -x -q tests/test_engine.py tests/test_baselines.py 2>&1 | tail -5 | tee -a "$LOG"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

step "full benchmark on cuda (qwen3-1.7b, bf16)"
timeout 300 python -m benchmarks.run --full --device cuda --dtype bf16 --model-shape qwen3-1.7b --rounds 1 \
    --sparse-attention mask 2>&1 | grep -v -i warn | tee -a "$LOG"
[ "${PIPESTATUS[0]}" -eq 0 ] || status=1

step "done (status $status)"
if [ -n "${OUT:-}" ]; then cp benchmarks/results/full-cuda-bf16.* "$LOG" "$OUT"/ 2>/dev/null; fi
exit $status
