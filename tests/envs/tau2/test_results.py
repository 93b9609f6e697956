"""`trl-dta analyze` on tau2-bench results files built with tau2's own classes (`Results`, `SimulationRun`, messages)
from real airline tasks: a good file (what was read printed, the greeting not a policy turn) and each broken kind tau2
itself rejects (a clear one-line error naming the file, the format and the field; exit status 2)."""

from __future__ import annotations

import json

import pytest

from trl_dta import cli
from trl_dta.envs.tau2 import Tau2Session, tau2_modules
from trl_dta.envs.tau2.results import describe, simulation_rewards

from .conftest import ScriptedPolicy, renderer_for

TRIALS = 2


def write_results(domain, tokenizer, task_ids, path):
    """Plays gold episodes (trial 0) and gold-without-its-first-action episodes (trial 1); saves tau2's `Results`,
    each simulation with the reward its episode graded itself with (`Tau2Session.reward`), as `tau2 run` stores
    its evaluator's."""
    t = tau2_modules()
    s = t.simulation
    renderer = renderer_for(domain, tokenizer)
    simulations = []
    for task_id in task_ids:
        gold = domain.gold_turns(domain.task(task_id))
        for trial, script in enumerate([gold, gold[1:]]):
            # tau2's trajectory starts with the agent's greeting, as `tau2 run` writes it
            messages = [t.message.AssistantMessage(role="assistant", content="Hi! How can I help you today?")]
            trajectory, reward = _trajectory(domain, tokenizer, renderer, task_id, script)
            simulations.append(s.SimulationRun(id=f"{task_id}-{trial}", task_id=task_id, trial=trial,
                                               start_time="", end_time="", duration=0.0,
                                               termination_reason="user_stop", messages=messages + trajectory,
                                               reward_info=reward))
    info = s.Info(git_commit="", num_trials=TRIALS, max_steps=100, max_errors=10,
                  user_info=s.UserInfo(implementation="user_simulator"),
                  agent_info=s.AgentInfo(implementation="llm_agent"),
                  environment_info=domain.environment.get_info())
    # tau2 writes simulations in completion order, not grouped: shuffle trials of tasks together
    simulations = simulations[1::2] + simulations[0::2]
    s.Results(info=info, tasks=[domain.task(i) for i in task_ids], simulations=simulations).save(path)


def _trajectory(domain, tokenizer, renderer, task_id, script):
    session = Tau2Session(domain, task_id, renderer)
    policy = ScriptedPolicy(tokenizer, {tuple(session.prompt_ids): script})
    while not session.done:
        session.step(policy([session.prompt_ids], [10**5])[0].ids)
    return session.trajectory, session.reward()


def test_reader_rewards_agree_with_tau2s_evaluator(tmp_path, mock, chat_tokenizer, capsys):
    """The rewards the reader reports (`simulation_rewards`, and their mean in `describe`) equal tau2's own
    `evaluate_simulation` run on each simulation as tau2 loads the file, on every mock task (the two without gold
    calls included). Where a task has gold calls, its gold episode scores 1 and the episode without its first call 0.
    Where tau2's evaluator raises (an environment check on a record the episode never created: `tau2 run` would stop
    there) the episode graded itself 0, as `Tau2Domain.evaluate` documents."""
    path = tmp_path / "results.json"
    task_ids = [task.id for task in mock.tasks]
    write_results(mock, chat_tokenizer, task_ids, path)
    stored = simulation_rewards(path)
    t = tau2_modules()
    results = t.simulation.Results.load(path)
    tasks = {task.id: task for task in results.tasks}

    def tau2_reward(sim):
        try:
            return t.evaluator.evaluate_simulation(simulation=sim, task=tasks[sim.task_id], solo_mode=False,
                                                   domain="mock", evaluation_type=t.evaluator.EvaluationType.ALL).reward
        except ValueError:
            return None

    fresh = {sim.id: tau2_reward(sim) for sim in results.simulations}
    assert len(stored) == len(fresh) == 2 * len(task_ids)
    graded = {k: v for k, v in fresh.items() if v is not None}
    assert {k: stored[k] for k in graded} == graded
    assert all(stored[k] == 0.0 for k, v in fresh.items() if v is None)
    for task in mock.tasks:
        if any(a.requestor == "assistant" for a in task.evaluation_criteria.actions or []):
            assert (stored[f"{task.id}-0"], stored[f"{task.id}-1"]) == (1.0, 0.0), task.id
    mean = sum(stored.values()) / len(stored)
    assert describe(path).endswith(f"tau2's rewards: mean {mean:.3f} over {len(stored)} graded simulations, "
                                   f"{sum(r == 1.0 for r in stored.values())} of them 1")


def test_analyze_reads_tau2_results(tmp_path, airline, chat_tokenizer, capsys):
    """Counts printed, trials grouped by task, tau2's greeting neither a per-turn row nor trained."""
    tasks = [t.id for t in airline.tasks[:3]]
    path = tmp_path / "results.json"
    write_results(airline, chat_tokenizer, tasks, path)
    tokdir = tmp_path / "tok"
    chat_tokenizer.save_pretrained(tokdir)
    data = json.loads(path.read_text())
    assert {"info", "tasks", "simulations"} <= set(data)
    assert cli.main(["analyze", str(path), "--tokenizer", str(tokdir), "--json", "--num-processes", "1"]) == 0
    out = capsys.readouterr()
    result = json.loads(out.out)
    assert out.err.startswith("tau2 results: domain airline, 3 tasks, 6 simulations; groups (the trials of a task): 3 "
                              "(3 of 2 trials)")
    assistant_turns = sum(1 for sim in data["simulations"] for m in sim["messages"]
                          if m["role"] == "assistant") - len(data["simulations"])  # minus the greetings
    assert result["episode"]["sequences"] == len(tasks) * TRIALS
    assert result["per_turn"]["sequences"] == assistant_turns  # the greeting is context, not a turn
    # every conversation starts with the same ~20K-token system prompt and tool schemas: both layouts share it
    assert result["episode"]["compression_ratio"] > 2.0
    assert result["per_turn"]["compression_ratio"] > result["episode"]["compression_ratio"]
    assert result["episode"]["balance"]["whole_groups"] is True  # grouped by task
    # two ranks: the trials of a task stay together (3 groups of 2 over 2 ranks cannot split; 2 tasks can)
    write_results(airline, chat_tokenizer, tasks[:2], path)
    assert cli.main(["analyze", str(path), "--tokenizer", str(tokdir), "--json", "--num-processes", "2"]) == 0
    two = json.loads(capsys.readouterr().out)
    assert two["episode"]["balance"]["whole_groups"] is True
    argv = ["analyze", str(path), "--tokenizer", str(tokdir), "--num-processes", "2", "--batch-size", "3"]
    assert cli.main(argv) == 2


def _broken(path, data: dict, kind: str) -> None:
    """`data` (a valid results file's JSON) broken as `kind`, written to `path`."""
    text = json.dumps(data)
    sim = data["simulations"][0]
    if kind == "truncated":
        path.write_text(text[: len(text) // 2])
        return
    if kind == "no_simulations":
        del data["simulations"]
    elif kind == "unknown_role":
        sim["messages"][1]["role"] = "robot"
    elif kind == "arguments_not_an_object":
        call = next(m for s in data["simulations"] for m in s["messages"] if m.get("tool_calls"))
        call["tool_calls"][0]["arguments"] = "not a dict"
    path.write_text(json.dumps(data))


@pytest.fixture(scope="module")
def one_task_results(tmp_path_factory, airline, chat_tokenizer) -> dict:
    path = tmp_path_factory.mktemp("tau2_results") / "results.json"
    task = next(t for t in airline.tasks
                if any(a.requestor == "assistant" for a in t.evaluation_criteria.actions or []))
    write_results(airline, chat_tokenizer, [task.id], path)
    return json.loads(path.read_text())


@pytest.mark.parametrize("kind,message", [
    ("truncated", "not valid JSON"),
    ("no_simulations", "field simulations: Field required"),
    ("unknown_role", "field simulations.0.messages.1.role: 'robot' is not one of tau2's message roles"),
    ("arguments_not_an_object", "arguments: Input should be a valid dictionary"),
])
def test_files_tau2_rejects_give_one_line_errors(tmp_path, one_task_results, capsys, kind, message):
    path = tmp_path / "results.json"
    _broken(path, json.loads(json.dumps(one_task_results)), kind)
    assert cli.main(["analyze", str(path), "--tokenizer", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "results.json" in err and message in err, err
    assert "tau2 results" in err and "Traceback" not in err


def test_help_and_offline_tokenizer(tmp_path, capsys, monkeypatch):
    """`--help` names the tau2 format; a hub name that is neither a folder nor cached fails at once offline, naming a
    local alternative."""
    assert cli.main(["analyze", "--help"]) == 0
    assert "tau2-bench results" in capsys.readouterr().out
    rows = tmp_path / "chats.jsonl"
    rows.write_text(json.dumps({"messages": [{"role": "user", "content": "hi"},
                                             {"role": "assistant", "content": "hello"}]}) + "\n")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert cli.main(["analyze", str(rows), "--tokenizer", "no-such-org/no-such-tokenizer"]) == 2
    err = capsys.readouterr().err
    assert "cannot be reached" in err and "build_chat_tokenizer().save_pretrained" in err
