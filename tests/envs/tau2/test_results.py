"""`trl-dta analyze` on a tau2-bench results file (tau2's `Results` JSON, made here from real airline tasks)."""

from __future__ import annotations

import json

from trl_dta import cli
from trl_dta.envs.tau2 import Tau2Session, tau2_modules

from .conftest import ScriptedPolicy, renderer_for

TRIALS = 2


def write_results(domain, tokenizer, task_ids, path):
    """Plays gold episodes (trial 0) and gold-without-its-first-action episodes (trial 1); saves tau2's `Results`."""
    t = tau2_modules()
    s = t.simulation
    renderer = renderer_for(domain, tokenizer)
    simulations = []
    for task_id in task_ids:
        gold = domain.gold_turns(domain.task(task_id))
        for trial, script in enumerate([gold, gold[1:]]):
            # tau2's trajectory starts with the agent's greeting, as `tau2 run` writes it
            messages = [t.message.AssistantMessage(role="assistant", content="Hi! How can I help you today?")]
            messages += _trajectory(domain, tokenizer, renderer, task_id, script)
            simulations.append(s.SimulationRun(id=f"{task_id}-{trial}", task_id=task_id, trial=trial,
                                               start_time="", end_time="", duration=0.0,
                                               termination_reason="user_stop", messages=messages))
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
    return session.trajectory


def test_analyze_reads_tau2_results(tmp_path, airline, chat_tokenizer, capsys):
    tasks = [t.id for t in airline.tasks[:3]]
    path = tmp_path / "results.json"
    write_results(airline, chat_tokenizer, tasks, path)
    tokdir = tmp_path / "tok"
    chat_tokenizer.save_pretrained(tokdir)
    data = json.loads(path.read_text())
    assert {"info", "tasks", "simulations"} <= set(data)
    assert cli.main(["analyze", str(path), "--tokenizer", str(tokdir), "--json", "--num-processes", "1"]) == 0
    result = json.loads(capsys.readouterr().out)
    assistant_turns = sum(1 for sim in data["simulations"] for m in sim["messages"]
                          if m["role"] == "assistant") - len(data["simulations"])  # minus the greetings
    assert result["episode"]["sequences"] == len(tasks) * TRIALS
    assert result["per_turn"]["sequences"] == assistant_turns + len(data["simulations"])
    # every conversation starts with the same ~20K-token system prompt and tool schemas: both layouts share it
    assert result["episode"]["compression_ratio"] > 2.0
    assert result["per_turn"]["compression_ratio"] > result["episode"]["compression_ratio"]
    assert result["episode"]["balance"]["whole_groups"] is True  # grouped by task
    # two ranks: the trials of a task stay together (3 groups of 2 over 2 ranks cannot split; 2 tasks can)
    write_results(airline, chat_tokenizer, tasks[:2], path)
    assert cli.main(["analyze", str(path), "--tokenizer", str(tokdir), "--json", "--num-processes", "2"]) == 0
    two = json.loads(capsys.readouterr().out)
    assert two["episode"]["balance"]["whole_groups"] is True
    assert cli.main(["analyze", str(path), "--tokenizer", str(tokdir), "--num-processes", "2", "--batch-size", "3"]) == 2
