"""Tool calls as an environment: parse the model's calls, run registered Python tools, answer.

    class Calculate(ToolEnvironment):
        tools = {"calculator": calculator, "lookup": lookup}
        def final_reward(self, answer): return float(self.label in answer)

The model calls a tool in its chat template's format (`tool_calls`; several calls run in order):

    <tool_call>{"name": "calculator", "arguments": {"expression": "2 + 3 * 4"}}</tool_call>

These tags may appear anywhere in the turn: this is the Hermes format of the Qwen2.5 / Qwen3
templates (a turn stops at "</tool_call>"). Alternatively, the whole turn is the call as JSON, as
the Llama 3.1+ templates write it (`{"name": ..., "parameters": {...}}`, after `<|python_tag|>`)
and as Mistral's does (`[TOOL_CALLS]` then a list of `{"name": ..., "arguments": {...}}`). Those
markers are special tokens that decoding drops, and either marker is accepted when present. Each
result goes back as a {"role": "tool"} message, which the runner renders with the chat template
(Qwen's template wraps it in <tool_response>), or as "tool: RESULT" lines when there is no
template. A turn with no call is the final answer: the episode ends with `final_reward(answer)`.

Tools run in worker processes by default. A call past `timeout` has its process killed, which
stops even a hang that holds the GIL (a huge integer power, a C loop). An abandoned thread would
instead go on eating CPU and could stall every episode. In this mode, tools must be importable
module-level functions. `isolation = "thread"` allows closures, and abandons a hung thread
rather than killing a process.
"""

import ast
import importlib
import importlib.util
import inspect
import json
import math
import operator
import re
import socket
import subprocess
import sys
import threading
from collections.abc import Callable, Mapping
from multiprocessing.connection import Connection

from ferrule_rollout.environments import Environment, EpisodeFailure, StepResult

CALL = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)
JSON_MARKERS = ("<|python_tag|>", "[TOOL_CALLS]")  # stripped where decoding kept them


def tool_calls(text: str) -> list[str] | None:
    """Return the calls in a model turn, each as its JSON text, or None for a turn without calls
    (the final answer). Calls are Hermes tags anywhere in the turn. Without tags, the whole turn
    must be a JSON object with "name" and "arguments" (or Llama's "parameters"), or a list of
    such objects (Mistral)."""
    tagged = CALL.findall(text)
    if tagged:
        return tagged
    body = text.strip()
    for marker in JSON_MARKERS:
        body = body.removeprefix(marker).strip()
    if not body.startswith(("{", "[")):
        return None
    try:
        value = json.loads(body)
    except json.JSONDecodeError:
        return None  # prose that starts with a bracket is an answer
    calls = value if isinstance(value, list) else [value]
    if not calls or not all(isinstance(c, dict) and "name" in c for c in calls):
        return None
    return [json.dumps(c) for c in calls]


class ToolError(Exception):
    """Raised by a tool for a mistake of the model's (bad arguments, no such row): the message
    goes back to the model as the tool's answer, and the episode goes on."""


class ToolEnvironment(Environment):
    """An environment whose turns are tool calls; subclass it and set `tools`."""

    tools: Mapping[str, Callable] = {}
    """Name -> function. Arguments come from the call's JSON as keyword arguments; a parameter
    named `metadata` gets the episode's metadata instead. Return text, or anything JSON can
    write; raise ToolError for the model's mistakes."""
    timeout: float = 5.0
    """Seconds per tool call; past it the episode fails ("tool_timeout")."""
    max_output_chars: int = 4000
    """Longer results are cut to this many characters, with a note saying so."""
    max_calls_per_turn: int = 4
    isolation: str = "process"
    """"process" (killable; tools must be importable functions) or "thread"."""
    stop = ("</tool_call>",)

    def reset(self, prompt, label, metadata):
        self.label, self.metadata = label, dict(metadata)
        return prompt

    def final_reward(self, answer: str) -> float:
        """The reward of the final answer (a turn without tool calls). Default 0.0."""
        return 0.0

    def step(self, model_output: str) -> StepResult:
        calls = tool_calls(model_output)
        if calls is None:
            return StepResult(None, self.final_reward(model_output))
        answers = [self.call(text) for text in calls[: self.max_calls_per_turn]]
        if len(calls) > self.max_calls_per_turn:
            answers.append(f"error: at most {self.max_calls_per_turn} tool calls per turn")
        return StepResult([{"role": "tool", "content": a} for a in answers], 0.0)

    def call(self, text: str) -> str:
        """Run one call, given as its JSON text (from `tool_calls`). Return the answer for the
        model."""
        try:
            call = json.loads(text)
        except json.JSONDecodeError as err:
            return f"error: a tool call must be JSON: {err}"
        if isinstance(call, dict) and "arguments" not in call and "parameters" in call:
            call["arguments"] = call.pop("parameters")  # Llama 3's name for them
        if not isinstance(call, dict) or not isinstance(call.get("arguments", {}), dict):
            return 'error: a tool call is {"name": ..., "arguments": {...}}'
        name, arguments = call.get("name"), dict(call.get("arguments", {}))
        if name not in self.tools:
            return f"error: no tool {name!r}; tools: {', '.join(sorted(self.tools))}"
        fn = self.tools[name]
        if "metadata" in arguments:
            return "error: 'metadata' is not an argument"
        if "metadata" in inspect.signature(fn).parameters:
            arguments["metadata"] = self.metadata
        try:
            inspect.signature(fn).bind(**arguments)
        except TypeError as err:
            return f"error: {name}: {err}"
        status, value = run_tool(fn, arguments, self.timeout, self.max_output_chars, self.isolation)
        if status == "ok":
            return value
        if status == "model_error":
            return f"error: {value}"
        raise EpisodeFailure(status, f"tool {name!r}: {value}")


# -- running a tool ---------------------------------------------------------------------------


def run_tool(fn, arguments: dict, timeout: float, cap: int, isolation: str = "process"):
    """Run one tool call and return (status, text). The status is "ok" with the capped result,
    "model_error" with a ToolError's message, or a failure reason ("tool_error", "tool_timeout",
    "tool_bad_output") with what happened."""
    if isolation == "thread":
        box = []
        thread = threading.Thread(target=lambda: box.append(_run(fn, arguments, cap)), daemon=True)
        thread.start()
        thread.join(timeout)
        return box[0] if box else ("tool_timeout", f"no result in {timeout:g}s (thread abandoned)")
    if isolation != "process":
        raise ValueError(f'isolation must be "process" or "thread", got {isolation!r}')
    module = sys.modules.get(fn.__module__)
    where = (fn.__module__, getattr(module, "__file__", None), fn.__qualname__)
    worker = _POOL.take()
    try:
        worker.send((where, arguments, cap))
    except Exception as err:  # an argument does not pickle
        _POOL.give_back(worker)
        return "tool_error", f"cannot send the call to a tool process: {err}"
    if not worker.poll(timeout):
        _POOL.kill(worker)
        return "tool_timeout", f"no result in {timeout:g}s (its process was killed)"
    try:
        result = worker.recv()
    except (EOFError, OSError) as err:  # the process died (os._exit, a crash, out of memory)
        _POOL.kill(worker)
        return "tool_error", f"the tool process died: {err!r}"
    _POOL.give_back(worker)
    return result


def _run(fn, arguments: dict, cap: int):
    try:
        value = fn(**arguments)
    except ToolError as err:
        return "model_error", str(err)[:cap]
    except Exception as err:
        return "tool_error", f"{type(err).__name__}: {err}"[:2000]
    if isinstance(value, str):
        text = value
    else:
        try:
            text = json.dumps(value, allow_nan=False)
        except (TypeError, ValueError):
            return "tool_bad_output", f"returned {type(value).__name__}, not text or JSON"
    if len(text) > cap:
        text = text[:cap] + f"... [cut: {len(text) - cap} more characters]"
    return "ok", text


def _find(module_name: str, file: str | None, qualname: str):
    """Find a tool function inside a tool process. Import it by module name, or else load it
    from its file (for a module that load_environment loaded from `path.py`)."""
    if module_name not in sys.modules:
        try:
            importlib.import_module(module_name)
        except ImportError:
            if not file:
                raise
            spec = importlib.util.spec_from_file_location(module_name, file)
            module = importlib.util.module_from_spec(spec)
            sys.modules[module_name] = module
            spec.loader.exec_module(module)
    target = sys.modules[module_name]
    for part in qualname.split("."):
        target = getattr(target, part)
    return target


def _serve(fd: int) -> None:
    """The loop of a tool process. It receives the parent's sys.path first, then
    (where, arguments, cap) calls."""
    conn = Connection(fd)
    sys.path[:] = conn.recv()
    while True:
        try:
            (module_name, file, qualname), arguments, cap = conn.recv()
        except EOFError:
            return
        try:
            fn = _find(module_name, file, qualname)
        except Exception as err:
            conn.send(
                (
                    "tool_error",
                    f"cannot import {module_name}:{qualname} in a tool process ({err!r}): tools "
                    'must be module-level functions of an importable module, or use isolation="thread"',
                )
            )
            continue
        conn.send(_run(fn, arguments, cap))


class _Pool:
    """Tool processes, at most `size` at once, started on demand as `python -c` children. This
    avoids forking a threaded parent and, unlike multiprocessing's spawn, does not re-run the
    caller's __main__. A process that timed out is killed, and a fresh one starts when
    needed."""

    size = 4

    def __init__(self):
        self._idle: list = []
        self._count = 0
        self._cv = threading.Condition()

    def take(self):
        with self._cv:
            self._cv.wait_for(lambda: self._idle or self._count < self.size)
            if self._idle:
                return self._idle.pop()
            self._count += 1
        try:
            ours, theirs = socket.socketpair()
            code = f"from ferrule_rollout.tools import _serve; _serve({theirs.fileno()})"
            process = subprocess.Popen(
                [sys.executable, "-c", code], pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL
            )
            theirs.close()
            conn = Connection(ours.detach())
            conn.send(list(sys.path))
        except BaseException:
            with self._cv:
                self._count -= 1
                self._cv.notify()
            raise
        return _Worker(conn, process)

    def give_back(self, worker) -> None:
        with self._cv:
            self._idle.append(worker)
            self._cv.notify()

    def kill(self, worker) -> None:
        worker.process.kill()
        worker.process.wait()
        worker.conn.close()
        with self._cv:
            self._count -= 1
            self._cv.notify()


class _Worker:
    def __init__(self, conn, process):
        self.conn, self.process = conn, process
        self.send, self.poll, self.recv = conn.send, conn.poll, conn.recv


_POOL = _Pool()


# -- the example tools ------------------------------------------------------------------------

_OPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}
MAX_BITS = 4096  # integers past ~1200 digits are refused: no tool answer needs more


def calculator(expression: str) -> str:
    """Arithmetic on numbers: + - * / // % ** and parentheses. Names, calls, attributes and
    numbers past MAX_BITS are refused with a ToolError (checked before computing, so 9**9**9
    is refused at once instead of running for hours)."""
    if not isinstance(expression, str) or len(expression) > 1000:
        raise ToolError("expression must be text of at most 1000 characters")
    try:
        tree = ast.parse(expression, mode="eval")
    except SyntaxError as err:
        raise ToolError(f"not an arithmetic expression: {err.msg}") from None
    return str(_evaluate(tree.body))


def _evaluate(node):
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_evaluate(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        left, right = _evaluate(node.left), _evaluate(node.right)
        ints = isinstance(left, int) and isinstance(right, int)
        big = ints and right > 0 and right * abs(left).bit_length() > MAX_BITS and abs(left) > 1
        if isinstance(node.op, ast.Pow) and big:
            raise ToolError(f"{left} ** {right} is too large to compute")
        try:
            value = _OPS[type(node.op)](left, right)
        except ZeroDivisionError:
            raise ToolError("division by zero") from None
        except OverflowError:
            raise ToolError("the result is too large") from None
        if isinstance(value, complex):
            raise ToolError("the result is not a real number")
        if isinstance(value, int) and value.bit_length() > MAX_BITS:
            raise ToolError("the result is too large")
        if isinstance(value, float) and not math.isfinite(value):
            raise ToolError("the result is not finite")
        return value
    what = {ast.Name: "names", ast.Attribute: "attributes", ast.Call: "calls"}.get(type(node))
    if isinstance(node, ast.Constant):
        what = f"{type(node.value).__name__} constants"
    raise ToolError(
        f"only numbers and + - * / // % ** are allowed, not {what or type(node).__name__}"
    )


def lookup(key: str, metadata: Mapping) -> str:
    """The row `key` of the table in the episode's metadata (`metadata["table"]`, a mapping)."""
    table = metadata.get("table")
    if not isinstance(table, Mapping):
        raise ToolError("this episode has no table to look up")
    if key not in table:
        keys = ", ".join(sorted(map(str, table))[:20])
        raise ToolError(f"no row {key!r}; rows: {keys}")
    value = table[key]
    return value if isinstance(value, str) else json.dumps(value)
