"""Reference implementations the tests (and benchmarks) compare against.

The oracle for every sequence is the plain model run on that sequence alone, unpadded (`position_ids = arange`),
with full logits and `log_softmax`. Nothing here uses trl_dta.
"""

from __future__ import annotations

import torch


def _text_config(model):
    return model.config.get_text_config()


def dense_logps(model, seq: torch.Tensor, temperature: float = 1.0, **inputs) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs and entropies of `seq` `(len,)` under `model`, each `(len - 1,)`, in the logits' dtype (float32
    for half-precision models). `inputs`: more of the model's forward arguments for this sequence (a vision-language
    model's `pixel_values`, `image_grid_thw`, `mm_token_type_ids`)."""
    if len(seq) == 0:
        empty = torch.zeros(0, dtype=torch.float32)
        return empty, empty
    logits = model(input_ids=seq[None], **inputs).logits[0, :-1]
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    logits = logits / temperature
    logp_all = logits.log_softmax(-1)
    logps = logp_all.gather(-1, seq[1:, None]).squeeze(-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logps, entropy


def dense_forward_backward(model, seqs, loss_fn, temperature: float = 1.0, n_scored=None, entropy: bool = True,
                           inputs=None):
    """`sum_i loss_fn(i, logps_i, entropy_i)`, one sequence at a time; gradients accumulate into `.grad`.
    With `n_scored`, only the last `n_scored[i]` log-probs of sequence `i` are passed on; with `inputs`, sequence
    `i`'s forward gets `**inputs[i]` too (its images).

    Returns `(total_loss, logps, entropies)` (detached).
    """
    total, lps, ents = 0.0, [], []
    for i, s in enumerate(seqs):
        s = torch.as_tensor(s, dtype=torch.long)
        lp, ent = dense_logps(model, s, temperature, **(inputs[i] if inputs is not None else {}))
        if n_scored is not None:
            keep = len(lp) - min(n_scored[i], len(lp))
            lp, ent = lp[keep:], ent[keep:]
        loss = loss_fn(i, lp, ent if entropy else None)
        if loss.requires_grad:
            loss.backward()
        total = total + loss.detach()
        lps.append(lp.detach())
        ents.append(ent.detach())
    return total, lps, ents


def grads_of(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def max_rel_err(a: torch.Tensor, b: torch.Tensor, floor: float = 0.0) -> float:
    """max |a - b| / max(max |b|, floor) (0 when both are empty)."""
    if a.numel() == 0 and b.numel() == 0:
        return 0.0
    a, b = a.double(), b.double()
    scale = max(b.abs().max().item(), floor)
    diff = (a - b).abs().max().item()
    return diff / scale if scale > 0 else diff


def compare_grads(got: dict, want: dict) -> tuple[float, str]:
    """Worst per-parameter relative error and the parameter's name.

    Each parameter's error is relative to its own largest reference gradient, floored at 1e-6 of the largest gradient
    of the model: a gradient that is zero in exact arithmetic (e.g. queries over identical values) is round-off on
    both sides and has no meaningful relative error. A gradient missing on one side (never back-propagated into)
    counts as zeros: it must then be all zero on the other side.
    """
    floor = 1e-6 * max((w.abs().max().item() for w in want.values() if w.numel()), default=0.0)
    worst, name = 0.0, ""
    for n in set(got) | set(want):
        g = got.get(n, torch.zeros_like(want.get(n, got.get(n))))
        w = want.get(n, torch.zeros_like(g))
        e = max_rel_err(g, w, floor)
        if e > worst:
            worst, name = e, n
    return worst, name


def compare_lists(got: list, want: list) -> tuple[float, int]:
    """Worst relative error over per-sequence vectors (relative to the largest reference magnitude)."""
    assert len(got) == len(want)
    scale = max((w.abs().max().item() for w in want if w.numel()), default=1.0) or 1.0
    worst, where = 0.0, -1
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.shape == w.shape, f"sequence {i}: shape {tuple(g.shape)} != {tuple(w.shape)}"
        if w.numel():
            e = (g.double() - w.double()).abs().max().item() / scale
            if e > worst:
                worst, where = e, i
    return worst, where
