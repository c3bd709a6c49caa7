"""A multi-turn task the tiny model can learn: reverse a word, with another try after a miss.

Turn 1 is the prompt ("Reverse the string abc. Answer:"). A right answer ends the episode with
reward 1. A wrong one gets the observation " Wrong. Answer:" and the model tries again, up to
`tries` answers; the episode's reward is then the last answer's share of letters in place (1.0
only when it is exact), so a second try that gets it right scores as well as a first.
Used by examples/agent-retry.toml: `uv run rlhf-launch examples/agent-retry.toml`.
"""

from ferrule_rollout.environments import Environment, StepResult


def letters_in_place(response: str, answer: str) -> float:
    hits = sum(a == b for a, b in zip(response, answer, strict=False))
    return hits / max(len(response), len(answer), 1)


class RetryReversal(Environment):
    def __init__(self, tries: int = 2):
        self.tries = tries

    def reset(self, prompt, label, metadata):
        self.answer, self.answers = label.strip(), 0
        return prompt

    def step(self, model_output: str) -> StepResult:
        self.answers += 1
        score = letters_in_place(model_output.strip(), self.answer)
        if score == 1.0 or self.answers >= self.tries:
            return StepResult(None, score, {"answers": self.answers})
        return StepResult(" Wrong. Answer:", 0.0)
