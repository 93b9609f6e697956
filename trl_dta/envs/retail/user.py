"""The scripted user simulator: answers the agent from the task's scenario and ends the call with a stop marker.

tau2-bench plays the user with an LLM that follows the scenario. Offline, a script does: it answers the questions it
recognises by keyword, from the facts of its task, and otherwise repeats its request. It hangs up, saying the stop
marker `(stop)`,

- satisfied, once the agent has said every piece of required information (so a write task is only satisfied after
  the agent has seen, and passed on, the refund or fee that the write tool returned), or
- unsatisfied, after `patience` agent messages in a row that it could not answer.

It only reads the agent's `say` messages: tool calls and malformed turns never reach it. Replies depend only on the
task and the messages so far, so an episode is reproducible given the agent's turns.
"""

from __future__ import annotations

from .tasks import Task

STOP = "(stop)"

# topic -> words in an agent message that ask about it.
_QUESTIONS = {
    "name": ("name", "who are"),
    "zip": ("zip",),
    "order": ("which order", "order id", "order number"),
    "item": ("item", "which product"),
    "reason": ("reason", "why"),
    "city": ("city", "where"),
    "confirm": ("confirm", "shall i", "should i", "proceed"),
}


_REASONS = {"mistake": "it was a mistake.", "unneeded": "it is unneeded now."}
# topic -> the user's answer, from the task's facts.
_ANSWERS = {
    "name": lambda task: f"i am {task.first} {task.last}.",
    "zip": lambda task: f"my zip is {task.zip}.",
    "order": lambda task: (f"the order is {task.order_id}." if task.knows_order_id
                           else f"i do not know, it has my {task.item}."),
    "item": lambda task: f"the {task.item}." if task.item else "it is about the whole order.",
    "reason": lambda task: _REASONS.get(task.reason, "it is not about a cancellation."),
    "city": lambda task: f"please ship it to {task.city}." if task.city else "the city is fine.",
    "confirm": lambda task: "yes, please.",
}


class UserSimulator:
    """The user of one episode.

    Args:
        task ([`~envs.retail.tasks.Task`]): the scenario.
        patience (`int`, *optional*, defaults to `3`): unanswerable agent messages in a row before the user hangs up.
    """

    def __init__(self, task: Task, patience: int = 3):
        self.task = task
        self.patience = patience
        self._unanswered = 0

    def reply(self, message: str, all_info_said: bool) -> tuple[str, bool]:
        """The user's answer to one agent message.

        Args:
            message (`str`): the agent's `say` text.
            all_info_said (`bool`): whether the agent has now said every piece of the task's required information.

        Returns:
            `tuple[str, bool]`: the reply and whether it ends the conversation (then it ends with `(stop)`).
        """
        if all_info_said:
            return f"thanks, that is all. {STOP}", True
        asked = [topic for topic, words in _QUESTIONS.items() if any(word in message for word in words)]
        answers = [_ANSWERS[topic](self.task) for topic in asked]
        if answers:
            self._unanswered = 0
            return " ".join(answers), False
        self._unanswered += 1
        if self._unanswered >= self.patience:
            return f"this is not helping, bye. {STOP}", True
        return self.task.goal, False
