"""Environments and tools for the episode tests, imported by path (`sys.path` gets this folder)
so that tool processes can import the tools too."""

import time
from typing import ClassVar

from ferrule_rollout.environments import Environment, StepResult
from ferrule_rollout.tools import ToolEnvironment, calculator


class TwoTurns(Environment):
    """Answers the model's first turn with a fixed observation; ends after the second."""

    def reset(self, prompt, label, metadata):
        self.outputs = []
        return prompt

    def step(self, model_output):
        self.outputs.append(model_output)
        if len(self.outputs) == 2:
            return StepResult(None, 1.0, {"turn": 2})
        return StepResult(" Observation: the answer is 42.", 0.25, {"turn": 1})


def hang(seconds: float = 600.0) -> str:
    time.sleep(seconds)
    return "woke up"


def junk() -> object:
    return object()


def boom() -> str:
    raise RuntimeError("the tool broke")


class Scripted(ToolEnvironment):
    """Ignores the model: each episode does what its metadata's "mode" says, through the real
    ToolEnvironment machinery (tool processes, timeouts) where the mode is a tool call."""

    tools: ClassVar[dict] = {"calculator": calculator, "hang": hang, "junk": junk, "boom": boom}
    timeout = 1.0

    def reset(self, prompt, label, metadata):
        self.mode = metadata["mode"]
        if self.mode == "bad_reset":
            return 17
        return super().reset(prompt, label, metadata)

    def step(self, model_output):
        if self.mode == "raise":
            raise KeyError("a bug in the environment")
        if self.mode == "hang":
            time.sleep(600)
        if self.mode == "garbage":
            return "not a step result"
        if self.mode.startswith("tool:"):
            call = f'<tool_call>{{"name": "{self.mode[5:]}", "arguments": {{}}}}</tool_call>'
            return super().step(call)
        if self.mode == "calculator" and not getattr(self, "asked", False):
            self.asked = True
            return super().step(
                '<tool_call>{"name": "calculator", "arguments": {"expression": "6 * 7"}}</tool_call>'
            )
        return StepResult(None, 1.0)
