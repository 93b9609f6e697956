"""`trl_dta.trainers.window`: one optimizer window through the engine, without a trainer.

The window's micro-batches are TRL-shaped batches (left-padded prompts, right-padded completions); the objective is a
plain per-sequence function, so the oracle is each sequence run alone (`reference.dense_forward_backward`), float64 to
1e-10: the one-pass path (a per-sequence objective), the two-pass path (only a micro-batch objective: its `dL/dlogps`
drives a second pass), in lockstep (FSDP2's per-layer schedule, agreed batch counts with idle batches), and the
dense-path decisions (compression below the minimum, a micro-batch DTA does not take, all-or-none under lockstep).
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from conftest import VOCAB, make_model
from reference import dense_forward_backward, grads_of, max_rel_err
from trl_dta.engine import DTAEngine
from trl_dta.parallel import Local
from trl_dta.trainers.step_forest import Cadence
from trl_dta.trainers.window import WindowContext, decide, router_request, run_window

TOL = 1e-10
SCALE = 0.5


def _batch(rows: list[tuple[list[int], list[int]]]) -> dict:
    """A TRL micro-batch: prompts left-padded, completions right-padded (pad 0)."""
    p_width, c_width = max(len(p) for p, _ in rows), max(len(c) for _, c in rows)
    batch = {key: torch.zeros(len(rows), width, dtype=torch.long) for key, width in
             (("prompt_ids", p_width), ("prompt_mask", p_width), ("completion_ids", c_width),
              ("completion_mask", c_width))}
    for i, (p, c) in enumerate(rows):
        batch["prompt_ids"][i, p_width - len(p):] = torch.tensor(p)
        batch["prompt_mask"][i, p_width - len(p):] = 1
        batch["completion_ids"][i, :len(c)] = torch.tensor(c)
        batch["completion_mask"][i, :len(c)] = 1
    return batch


def _window() -> list[dict]:
    """Three micro-batches sharing a system prompt; one prompt's completions spread over two micro-batches."""
    g = torch.Generator().manual_seed(0)

    def rnd(n):
        return torch.randint(3, VOCAB, (n,), generator=g).tolist()

    system, a, b = rnd(7), rnd(3), rnd(4)
    return [_batch([(system + a, rnd(5)), (system + a, rnd(3))]),
            _batch([(system + a, rnd(4)), (system + b, rnd(6)), (system + b, rnd(2))]),
            _batch([(rnd(5), rnd(4))])]


def _weights(batch: dict) -> torch.Tensor:
    """A fixed per-token weight `(B, T)` of each micro-batch (the stand-in for TRL's advantages and normalisers)."""
    ids = batch["completion_ids"].double()
    return (torch.cos(ids) + 0.1 * torch.arange(ids.size(0), dtype=torch.float64)[:, None]) * batch["completion_mask"]


def _term(batch: dict, j: int, logps: torch.Tensor, entropies: torch.Tensor) -> torch.Tensor:
    """Row `j`'s term of the objective: weighted log-probs plus an entropy bonus, on its `C_j` completion tokens."""
    w = _weights(batch)[j, :logps.size(0)].to(logps.dtype)
    return (w * logps).sum() - 0.01 * entropies.sum()


def _context(model, batches, *, one_pass=True, min_compression=1.0, router_coef=None) -> WindowContext:
    def sequence_loss(batch):
        if not one_pass:
            return None
        return lambda j, logps, entropies: SCALE * _term(batch, j, logps, entropies)

    def batch_loss(batch, logps, entropies):  # the same objective on `(B, T)` tensors (padding columns weigh 0)
        mask = batch["completion_mask"].to(logps.dtype)
        return (_weights(batch).to(logps.dtype) * logps).sum() - 0.01 * (entropies * mask).sum()

    return WindowContext(model=model, steps=tuple(range(len(batches))), batches=tuple(batches), scale=SCALE,
                         temperature=0.7, min_compression=min_compression, sequence_loss=sequence_loss,
                         batch_loss=batch_loss, router_coef=router_coef, autocast=contextlib.nullcontext,
                         device=torch.device("cpu"))


class _Lockstep(Local):
    """FSDP2's per-layer schedule on one process: the ranks agree on `extra` more row batches than this one runs."""

    lockstep = agreed = True

    def __init__(self, extra: int = 0, agree: bool = True):
        self.extra, self.agree = extra, agree

    def all_ranks(self, flag: bool) -> bool:
        return flag and self.agree

    @contextlib.contextmanager
    def engine_call(self, model, train: bool):
        yield lambda n: n + self.extra


def _oracle(model, batches):
    """Each sequence alone, with its micro-batch's term: total gradient and each micro-batch's `(B, T)` log-probs."""
    model.zero_grad()
    logps = []
    for batch in batches:
        seqs = [torch.cat([p[m.bool()], c[n.bool()]]) for p, m, c, n in
                zip(batch["prompt_ids"], batch["prompt_mask"], batch["completion_ids"], batch["completion_mask"])]
        lengths = batch["completion_mask"].sum(1).tolist()
        _, lps, _ = dense_forward_backward(model, seqs, lambda j, lp, e, b=batch: SCALE * _term(b, j, lp, e),
                                           temperature=0.7, n_scored=lengths)
        table = torch.zeros(batch["completion_ids"].shape, dtype=torch.float64)
        for i, (lp, n) in enumerate(zip(lps, lengths)):
            table[i, :n] = lp
        logps.append(table)
    grads = grads_of(model)
    model.zero_grad()
    return grads, logps


@pytest.mark.parametrize("path", ["one_pass", "two_pass", "lockstep"])
def test_run_window_float64_equals_oracle(path):
    model = make_model("qwen2")
    batches = _window()
    want_grads, want_logps = _oracle(model, batches)
    engine = DTAEngine(model, max_batch_tokens=24)
    strategy = _Lockstep(extra=2) if path == "lockstep" else Local()
    result = run_window(engine, _context(model, batches, one_pass=path != "two_pass"), strategy)
    got = grads_of(model)
    assert set(got) == set(want_grads)
    assert max(max_rel_err(got[n], want_grads[n]) for n in got) <= TOL
    assert sorted(result.micro_steps) == [0, 1, 2] and result.forest.steps == [0, 1, 2]
    for k, logps in enumerate(want_logps):
        step = result.micro_steps[k]
        assert step.batch is batches[k] and step.logps.shape == logps.shape
        assert max_rel_err(step.logps, logps) <= TOL
        assert step.compression >= 1.0
    tree = result.forest.tree
    assert result.metrics["dta/compression_ratio"] == tree.compression_ratio > 1.0
    assert result.metrics["dta/micro_batches_per_forest"] == 3.0
    assert result.metrics["dta/forward_tokens"] >= tree.n_tree_tokens * (2 if path == "two_pass" else 1)
    assert ("dta/idle_batches" in result.metrics) == (path == "lockstep")
    if path == "lockstep":
        assert result.metrics["dta/idle_batches"] == 2.0


def test_window_below_min_compression_runs_dense():
    model = make_model("qwen2")
    batches = _window()
    result = run_window(DTAEngine(model), _context(model, batches, min_compression=100.0), Local())
    assert result.forest is None and result.metrics == {} and result.seconds == 0.0
    assert all(step.logps is None for step in result.micro_steps.values())
    assert all(p.grad is None for p in model.parameters()), "the dense decision still ran the engine"


def test_a_micro_batch_dta_does_not_take_is_left_dense():
    # A vision input in micro-batch 1: DTA runs the other two; under lockstep, none (the ranks' calls must pair).
    model = make_model("qwen2")
    batches = _window()
    batches[1]["pixel_values"] = torch.zeros(1)
    result = run_window(DTAEngine(model), _context(model, batches), Local())
    assert result.forest.steps == [0, 2]
    assert result.micro_steps[1].logps is None and result.micro_steps[0].logps is not None
    model.zero_grad()
    result = run_window(DTAEngine(model), _context(model, batches), _Lockstep())
    assert result.forest is None and all(step.logps is None for step in result.micro_steps.values())


def test_decide_asks_the_ranks():
    model = make_model("qwen2")
    forest_tree = run_window(DTAEngine(model), _context(model, _window()), Local()).forest.tree
    assert decide(forest_tree, 1.0, Local()) and not decide(forest_tree, 100.0, Local())
    assert not decide(None, 1.0, Local())
    assert not decide(forest_tree, 1.0, _Lockstep(agree=False)), "a rank that does not compress makes all go dense"


def test_router_request_one_group_per_micro_batch():
    model = make_model("qwen2")
    forest = run_window(DTAEngine(model), _context(model, _window()), Local()).forest
    assert router_request(forest, None) is None
    request = router_request(forest, 0.25)
    assert request.groups == [[0, 1], [2, 3, 4], [5]] and list(request.coefs) == [0.25] * 3


@pytest.mark.parametrize("spg,iterations,buffered,expected",
                         [(2, 1, True, [True, False, True, False]), (2, 2, True, [True, False, False, False]),
                          (3, 1, False, [True, True, True, True])])
def test_cadence_is_trls_regeneration_rule(spg, iterations, buffered, expected):
    cadence = Cadence(spg, iterations)
    buffer = [{}] * spg if buffered else None
    assert [cadence.generates(step, buffer) for step in range(4)] == expected
    assert [cadence.index(step) for step in range(4)] == [step % spg for step in range(4)]
    assert cadence.generate_every == spg * iterations
