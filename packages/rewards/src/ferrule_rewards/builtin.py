"""Built-in reward functions, for the examples and as templates for your own.

    rlhf-rewards serve --function ferrule_rewards.builtin:exact_match

exact_match(response, label)   1.0 when the response's final answer equals the label, else 0.0
format_reward(response)        1.0 when the response gives exactly one marked final answer
                               (after its <think> block, if it has one), else 0.0
math_reward(response, label)   exact_match + 0.1 * format_reward, with both as sub-scores
number_match(response, label)  1.0 when the response's final number equals the label as a
                               number: free-form reasoning that never marks its answer scores
                               too (GSM8K style), else 0.0
exact_text(response, label)    1.0 when the whole response, stripped, is the label, else 0.0
char_match(response, label)    the fraction of the label's characters the response has in place
                               (partial credit; the tiny example's reward)

A final answer is the last `\\boxed{...}`, else the last `#### ...` line (GSM8K style), else
the last `answer is ...` / `Answer: ...`. Answers compare as numbers when both are numbers
("1,000" == "1000.0", "0.5" == "1/2"), otherwise as text, ignoring case, spaces, `$` and a
final period.
"""

import re
from fractions import Fraction

# Everything here takes time linear in the response. A reward server scores untrusted model
# output, and a regex that backtracks holds the GIL for the whole match, which freezes every
# request in the process. `^\s*####\s*(.+?)\s*$` took 19 s on 59 KiB of newlines (`\s` crosses
# them). A run of spaces inside an answer line, and repeated `\boxed{` with no closing brace,
# were quadratic too. So each pattern below is a fixed marker with one run of in-line
# whitespace (`[^\S\n]*`: whitespace but not a newline) inside it and nothing after it. That
# run directly follows a line start or the word "answer", so only one starting position ever
# scans it. A failed attempt costs O(run), and all attempts together cost O(len(text)). The
# answer itself, which is the rest of the marker's line, is cut out with str.find and str.strip.
#
# A marker and its answer sit on one line: unlike the `\s` of earlier versions, nothing crosses
# a newline. "The answer is\n42" and a bare "####" line followed by "42" mark no answer (they
# used to give "42"), and an answer that is only whitespace does not count (it used to give " ").
_HASHES = re.compile(r"^[^\S\n]*####", re.MULTILINE)
_ANSWER_IS = re.compile(r"answer[^\S\n]*(?:is|:)", re.IGNORECASE)
_BOXED = "\\boxed{"
# Linear under fullmatch too: a failed match backtracks over each run of digits once, testing
# one character per step. It also never sees more than _MAX_NUMBER_CHARS characters.
_NUMBER = re.compile(r"[-+]?(\d+(\.\d*)?|\.\d+)(/\d+)?")
# A number in running text: "1,234.5" (thousands separated by commas), "42", "-3", "0.25". It is
# linear: no quantified group contains another, and at each start position the first
# alternative gives up within three digits. A minus sign counts only where it cannot be a
# binary minus ("10-3").
_NUMBER_IN_TEXT = re.compile(r"(?:(?<![\w)\]])-)?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")
# Python's default int_max_str_digits. int() of more digits raises ValueError, and it takes
# superlinear time where a process lifts that limit. A longer "number" compares as text.
_MAX_NUMBER_CHARS = 4300


def _boxed(text: str) -> list[tuple[int, int]]:
    """The (start, end) spans of the contents of every `\\boxed{...}`, with braces balanced, in
    order of start.

    One pass matches braces with a stack. (Scanning ahead from each `\\boxed{` for its closing
    brace was quadratic when the braces never balance.) It returns spans, not strings, because
    the contents of nested boxes can add up to far more than the text."""
    openers, start = [], text.find(_BOXED)  # openers: the position of each `\boxed{`'s brace
    while start != -1:
        openers.append(start + len(_BOXED) - 1)
        start = text.find(_BOXED, start + len(_BOXED))
    if not openers:
        return []
    closer, unclosed = {}, []  # closer: {an opening brace's position: its closing one's}
    for position, char in enumerate(text[openers[0] :], openers[0]):
        if char == "{":
            unclosed.append(position)
        elif char == "}" and unclosed:
            closer[unclosed.pop()] = position
    return [(opener + 1, closer[opener]) for opener in openers if opener in closer]


def _line_answers(text: str, marker: re.Pattern[str]) -> list[str]:
    """The rest of each line after its first `marker`, stripped, where that is not empty."""
    found, position = [], 0
    while match := marker.search(text, position):
        line_end = text.find("\n", match.end())
        line_end = len(text) if line_end == -1 else line_end
        if answer := text[match.end() : line_end].strip():
            found.append(answer)
        position = line_end + 1
    return found


def _marked_answers(text: str) -> tuple[int, str | None]:
    """Count the marked final answers in `text` of the kind that takes precedence (boxed, then
    `####`, then `answer is`), and return the count and the last of them."""
    if boxes := _boxed(text):
        begin, end = boxes[-1]
        return len(boxes), text[begin:end]
    for marker in (_HASHES, _ANSWER_IS):
        if answers := _line_answers(text, marker):
            return len(answers), answers[-1]
    return 0, None


def final_answer(text: str) -> str | None:
    """The last marked final answer in `text`, or None when there is none."""
    return _marked_answers(text)[1]


def _normalize(answer: str) -> str:
    answer = answer.strip().strip("$").strip().removesuffix(".").strip()
    return " ".join(answer.lower().split())


def _as_number(answer: str) -> Fraction | None:
    answer = answer.replace(",", "").replace(" ", "")
    if len(answer) > _MAX_NUMBER_CHARS or not _NUMBER.fullmatch(answer):
        return None
    try:
        return Fraction(answer)
    except (ValueError, ZeroDivisionError):
        return None


def answers_match(answer: str, reference: str) -> bool:
    answer, reference = _normalize(answer), _normalize(reference)
    number, reference_number = _as_number(answer), _as_number(reference)
    if number is not None and reference_number is not None:
        return number == reference_number
    return answer == reference


def exact_match(response: str, label: str) -> float:
    if not label:
        raise ValueError("exact_match needs the reference answer in the sample's `label`")
    answer = final_answer(response)
    return float(answer is not None and answers_match(answer, label))


def final_number(text: str) -> str | None:
    """The marked final answer of `text` where it has one (see final_answer), else the last
    number written in it, or None."""
    if (marked := final_answer(text)) is not None:
        return marked
    last = None
    for last in _NUMBER_IN_TEXT.finditer(text):  # noqa: B007 (the last one is wanted)
        pass
    return last.group() if last else None


def number_match(response: str, label: str) -> float:
    if _as_number(_normalize(label)) is None:
        raise ValueError(f"number_match needs a number as the sample's `label`, got {label!r:.40}")
    answer = final_number(response)
    return float(answer is not None and answers_match(answer, label))


def format_reward(response: str) -> float:
    closed = response.rfind("</think>")
    if "<think>" in response and closed == -1:
        return 0.0  # reasoning never finished
    after_thinking = response[closed + len("</think>") :] if closed != -1 else response
    return float(_marked_answers(after_thinking)[0] == 1)


def math_reward(response: str, label: str) -> dict[str, float]:
    accuracy, form = exact_match(response, label), format_reward(response)
    return {"reward": accuracy + 0.1 * form, "accuracy": accuracy, "format": form}


def exact_text(response: str, label: str) -> float:
    return float(response.strip() == label.strip())


def char_match(response: str, label: str) -> float:
    """1.0 exactly when the response is the label. A response that is too long or too short
    loses credit for the characters it adds or lacks. A tiny model's early samples are rarely
    exactly right, and partial credit gives GRPO a signal to climb from there."""
    response, label = response.strip(), label.strip()
    hits = sum(a == b for a, b in zip(response, label, strict=False))
    return hits / max(len(response), len(label), 1)
