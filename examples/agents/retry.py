"""A multi-turn task the tiny model can learn: reverse a word, with another try after a miss.

Turn 1 is the prompt ("Reverse the string abc. Answer:"). Each answer earns its share of letters
in place, halved (partial credit, as the tiny example's `char_match` gives); an exact answer
earns 1 and ends the episode. After a wrong answer the environment says " Wrong. Answer:" and
the model tries again, up to `tries` answers. So an exact first answer scores 1.0, the only
score that reaches 1, and a miss followed by a better second answer scores more than a miss
followed by a worse one. Used by examples/agent-retry.toml.
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
        if score == 1.0:
            return StepResult(None, 1.0, {"answers": self.answers})
        if self.answers >= self.tries:
            return StepResult(None, score / 2, {"answers": self.answers})
        return StepResult(" Wrong. Answer:", score / 2)
