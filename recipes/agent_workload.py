"""The workload of `recipes/agent.py`: the domain's dataset, rollout function and rewards (`--agent_domain`: the
stand-in or a tau2-bench domain), and the episode budget derived from its prompts."""

from __future__ import annotations

from dataclasses import dataclass

from trl_dta.envs import SHAPED_REWARDS, AgentRolloutFunc, RetailDomain, build_dataset, episode_reward, outcome_reward


@dataclass
class Workload:
    """The domain's dataset, rollout function and rewards, and what the run prints about them."""

    dataset: object
    rollout: object
    reward_funcs: list
    reward_weights: list[float] | None
    info: dict


def _common_prefix(rows: list[list[int]]) -> int:
    first, n = rows[0], min(map(len, rows))
    for row in rows[1:]:
        k = 0
        while k < n and row[k] == first[k]:
            k += 1
        n = k
    return n


def build_workload(script_args, training_args, tokenizer, embedded: bool = True) -> Workload:
    """The dataset, rollout function and rewards of `--agent_domain`, `agent_max_tokens` derived when unset. With a
    pretrained chat model (`embedded=False` and a chat template) the stand-in's turns are chat messages
    (`trl_dta.envs.retail.chat_turns.ChatTurns`), and tau2's episodes start with a demonstration from a held-out
    task.

    Args:
        script_args (`AgentScriptArguments`): the recipe's `--agent_*` arguments.
        training_args (`DTAGRPOConfig`): the trainer's config (`seed`, `max_completion_length`).
        tokenizer: the policy's tokenizer.
        embedded (`bool`, *optional*, defaults to `True`): the embedded tiny model (else a pretrained one).
    """
    standin = script_args.agent_domain == "standin"
    reward = script_args.agent_reward or ("shaped" if standin else "outcome")
    turn_budget = training_args.max_completion_length + script_args.agent_reply_tokens
    if standin:
        domain = RetailDomain(seed=training_args.seed, num_users=script_args.agent_num_users,
                              policy_chars=script_args.agent_policy_chars)
        dataset = build_dataset(domain, script_args.agent_num_tasks)
        chat = bool(getattr(tokenizer, "chat_template", None)) and not embedded
        if chat:  # a pretrained chat model: the protocol in its chat template (`trl_dta.envs.retail.chat_turns`)
            from trl_dta.envs.retail.chat_turns import ChatTurns

            turns = ChatTurns(tokenizer, domain)
            prompts = [turns.prompt_ids(task_id) for task_id in dataset["task_id"]]
        else:
            prompts = [tokenizer(prompt)["input_ids"] for prompt in dataset["prompt"]]
        info = {"domain": "standin" + (" (chat template)" if chat else ""), "task_split": None,
                "num_tasks": len(dataset), "tools": 6, "policy_chars": len(domain.system_prompt)}
        outcome = {"shaped": SHAPED_REWARDS, "episode": ([episode_reward], None), "outcome": ([outcome_reward], None)}
    else:
        from trl_dta.envs.core.chat import ChatRenderer, ensure_tool_template
        from trl_dta.envs.tau2 import TAU2_VERSION, Tau2Domain, build_tau2_dataset, gold_demonstration, tau2_reward

        domain = Tau2Domain(script_args.agent_domain, task_split=script_args.agent_task_split,
                            policy_chars=script_args.agent_policy_chars or None)
        task_ids, demonstration, demo_task = domain.task_ids, [], None
        if not embedded:  # a pretrained model: a template with tools, and one solved held-out task shown first
            ensure_tool_template(tokenizer)
            demo_task = _demonstration_task(domain)
            if demo_task is not None:
                demonstration = gold_demonstration(domain, demo_task, seed=training_args.seed)
                task_ids = [t for t in task_ids if t != demo_task]
        dataset = build_tau2_dataset(domain, task_ids[:script_args.agent_num_tasks], seed=training_args.seed,
                                     demonstration=demonstration)
        renderer = ChatRenderer(tokenizer, domain.tool_schemas)
        prompts = [renderer.prompt_ids(prompt) for prompt in dataset["prompt"]]
        info = {"domain": f"{domain.name} (tau2-bench {TAU2_VERSION})", "task_split": script_args.agent_task_split,
                "num_tasks": len(dataset), "tools": len(domain.tool_schemas), "policy_chars": len(domain.policy),
                "demonstration": demo_task}
        outcome = {"shaped": SHAPED_REWARDS, "outcome": ([tau2_reward], None)}
    longest = max(map(len, prompts))
    max_tokens = script_args.agent_max_tokens
    if max_tokens is None:
        max_tokens = longest + script_args.agent_max_turns * turn_budget
        info["max_tokens_rule"] = (f"longest prompt {longest} + {script_args.agent_max_turns} turns x "
                                   f"({training_args.max_completion_length} + {script_args.agent_reply_tokens})")
    if max_tokens <= longest:
        raise ValueError(f"--agent_max_tokens {max_tokens} leaves no room for a turn after the longest prompt "
                         f"({longest} tokens); raise it or leave it unset (derived from the prompt and the turns).")
    info.update(system_prompt_tokens=_common_prefix(prompts), prompt_tokens=[min(map(len, prompts)), longest],
                max_tokens=max_tokens, reward=reward)
    kwargs = dict(max_turns=script_args.agent_max_turns, max_tokens=max_tokens,
                  generation_cache=script_args.agent_generation_cache)
    if standin:
        rollout = AgentRolloutFunc(domain, branching=script_args.agent_branching,
                                   branch_turns=script_args.agent_branch_turns, chat=chat, **kwargs)
    else:
        from trl_dta.envs.tau2 import Tau2RolloutFunc

        rollout = Tau2RolloutFunc(domain, seed=training_args.seed, demonstration=demonstration, **kwargs)
    funcs, weights = outcome[reward]
    return Workload(dataset, rollout, list(funcs), None if weights is None else list(weights), info)


def _demonstration_task(domain) -> str | None:
    """The task a pretrained model is shown solved before its own (held out of training): the last task of the split
    whose gold actions are all the agent's tool calls (at least one, none a transfer to a human); `None` when there is
    none."""
    for task_id in reversed(domain.task_ids):
        criteria = domain.task(task_id).evaluation_criteria
        actions = list(criteria.actions or []) if criteria is not None else []
        if actions and all(a.requestor == "assistant" and a.name != "transfer_to_human_agents" for a in actions):
            return task_id
    return None
