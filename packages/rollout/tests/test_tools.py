"""The calculator and lookup tools, ToolEnvironment's call parsing, and tool processes: a tool
that hangs is killed at its timeout and the next call gets a fresh process."""

import sys
import time
from pathlib import Path

import pytest

from ferrule_rollout.environments import EpisodeFailure
from ferrule_rollout.tools import (
    ToolEnvironment,
    ToolError,
    calculator,
    lookup,
    run_tool,
    tool_calls,
)

sys.path.insert(0, str(Path(__file__).parent))
from episode_helpers import hang


@pytest.mark.parametrize(
    ("expression", "value"),
    [("2 + 3 * 4", "14"), ("(2 + 3) * 4", "20"), ("2 ** 10", "1024"), ("7 / 2", "3.5"),
     ("7 // 2", "3"), ("-7 % 3", "2"), ("1.5e3 - 1", "1499.0"), ("2 ** -1", "0.5")],
)  # fmt: skip
def test_calculator_computes(expression, value):
    assert calculator(expression) == value


@pytest.mark.parametrize(
    ("expression", "message"),
    [("9**9**9", "too large"), ("2 ** 100000", "too large"), ("10.0 ** 400", "too large"),
     ("__import__('os')", "not calls"), ("x + 1", "not names"), ("(1).real", "not attributes"),
     ("'a' * 3", "not str constants"), ("True + 1", "not bool"), ("1 / 0", "division by zero"),
     ("(-8) ** 0.5", "not a real number"), ("2 +", "not an arithmetic expression"),
     ("1" * 2000, "at most 1000 characters")],
)  # fmt: skip
def test_calculator_refuses_quickly(expression, message):
    start = time.monotonic()
    with pytest.raises(ToolError, match=message):
        calculator(expression)
    assert time.monotonic() - start < 1


def test_lookup_reads_the_episode_table():
    metadata = {"table": {"paris": "France", "rome": {"country": "Italy"}}}
    assert lookup("paris", metadata) == "France"
    assert lookup("rome", metadata) == '{"country": "Italy"}'
    with pytest.raises(ToolError, match="no row 'oslo'; rows: paris, rome"):
        lookup("oslo", metadata)
    with pytest.raises(ToolError, match="no table"):
        lookup("paris", {})


class Tools(ToolEnvironment):
    tools = {"calculator": calculator, "lookup": lookup, "hang": hang}  # noqa: RUF012
    timeout = 1.0
    max_output_chars = 20


def test_tool_calls_are_parsed_and_answered():
    env = Tools()
    env.reset("q", "", {"table": {"k": "v" * 50}})
    step = env.step(
        'I will compute. <tool_call>{"name": "calculator", "arguments": {"expression": "6*7"}}'
        '</tool_call> and <tool_call>\n{"name": "lookup", "arguments": {"key": "k"}}\n</tool_call>'
    )
    assert step.observation == [
        {"role": "tool", "content": "42"},
        {"role": "tool", "content": "v" * 20 + "... [cut: 30 more characters]"},
    ]
    # The model's mistakes come back to it; the episode goes on.
    mistakes = {
        "<tool_call>not json</tool_call>": "error: a tool call must be JSON",
        '<tool_call>{"name": "nope"}</tool_call>': "error: no tool 'nope'; tools: calculator",
        '<tool_call>{"name": "calculator", "arguments": {"x": 1}}</tool_call>': "error: calculator:",
        '<tool_call>{"name": "calculator", "arguments": {"expression": "a"}}': "error: only numbers",
        '<tool_call>{"name": "lookup", "arguments": {"key": "k", "metadata": {}}}</tool_call>': (
            "error: 'metadata' is not an argument"
        ),
    }
    for output, answer in mistakes.items():
        (message,) = env.step(output).observation
        assert message["content"].startswith(answer), (output, message)
    final = env.step("The answer is 42.")
    assert final.observation is None and final.reward == 0.0


def test_the_json_formats_of_other_chat_templates_are_calls_too():
    env = Tools()
    env.reset("q", "", {"table": {"k": "v"}})
    llama = '<|python_tag|>{"name": "calculator", "parameters": {"expression": "6*7"}}'
    assert env.step(llama).observation == [{"role": "tool", "content": "42"}]
    assert env.step(llama.removeprefix("<|python_tag|>")).observation[0]["content"] == "42"
    mistral = '[TOOL_CALLS] [{"name": "calculator", "arguments": {"expression": "1+1"}}, ' + (
        '{"name": "lookup", "arguments": {"key": "k"}}]'
    )
    assert [m["content"] for m in env.step(mistral).observation] == ["2", "v"]
    # JSON that is not a call, or prose, is the final answer
    for answer in ('{"answer": 42}', "[1, 2]", "[see above] 42", "{not json"):
        assert tool_calls(answer) is None, answer
        assert env.step(answer).observation is None


def test_a_hanging_tool_is_killed_and_the_next_call_runs():
    env = Tools()
    env.reset("q", "", {})
    start = time.monotonic()
    with pytest.raises(EpisodeFailure) as failure:
        env.step('<tool_call>{"name": "hang", "arguments": {}}</tool_call>')
    assert failure.value.reason == "tool_timeout" and time.monotonic() - start < 5
    assert run_tool(calculator, {"expression": "1+1"}, 5.0, 100) == ("ok", "2")
    # Threads cannot be killed, but the call still returns at its timeout.
    assert run_tool(hang, {"seconds": 3}, 0.2, 100, isolation="thread")[0] == "tool_timeout"


def test_a_tool_that_is_not_importable_says_what_to_do():
    def local() -> str:
        return "x"

    status, message = run_tool(local, {}, 5.0, 100)
    assert status == "tool_error" and 'isolation="thread"' in message
    assert run_tool(local, {}, 5.0, 100, isolation="thread") == ("ok", "x")
