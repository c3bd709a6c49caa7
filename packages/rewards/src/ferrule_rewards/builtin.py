"""Built-in reward functions, for the examples and as templates for your own.

    rlhf-rewards serve --function ferrule_rewards.builtin:exact_match

exact_match(response, label)   1.0 when the response's final answer equals the label, else 0.0
format_reward(response)        1.0 when the response gives exactly one marked final answer
                               (after its <think> block, if it has one), else 0.0
math_reward(response, label)   exact_match + 0.1 * format_reward, with both as sub-scores
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

_HASHES = re.compile(r"^\s*####\s*(.+?)\s*$", re.MULTILINE)
_ANSWER_IS = re.compile(r"answer\s*(?:is|:)\s*(.+?)\s*$", re.IGNORECASE | re.MULTILINE)
_NUMBER = re.compile(r"[-+]?(\d+(\.\d*)?|\.\d+)(/\d+)?")


def _boxed(text: str) -> list[str]:
    """The contents of every `\\boxed{...}`, braces balanced."""
    found, start = [], text.find("\\boxed{")
    while start != -1:
        depth, begin = 0, start + len("\\boxed{")
        for position in range(begin, len(text)):
            depth += {"{": 1, "}": -1}.get(text[position], 0)
            if depth < 0:
                found.append(text[begin:position])
                break
        start = text.find("\\boxed{", start + 1)
    return found


def _marked_answers(text: str) -> list[str]:
    """Every marked final answer, of the kind that takes precedence."""
    for pattern in (_boxed(text), _HASHES.findall(text), _ANSWER_IS.findall(text)):
        if pattern:
            return pattern
    return []


def final_answer(text: str) -> str | None:
    """The last marked final answer in `text`, or None when there is none."""
    answers = _marked_answers(text)
    return answers[-1] if answers else None


def _normalize(answer: str) -> str:
    answer = answer.strip().strip("$").strip().removesuffix(".").strip()
    return " ".join(answer.lower().split())


def _as_number(answer: str) -> Fraction | None:
    answer = answer.replace(",", "").replace(" ", "")
    if not _NUMBER.fullmatch(answer):
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


def format_reward(response: str) -> float:
    closed = response.rfind("</think>")
    if "<think>" in response and closed == -1:
        return 0.0  # reasoning never finished
    after_thinking = response[closed + len("</think>") :] if closed != -1 else response
    return float(len(_marked_answers(after_thinking)) == 1)


def math_reward(response: str, label: str) -> dict[str, float]:
    accuracy, form = exact_match(response, label), format_reward(response)
    return {"reward": accuracy + 0.1 * form, "accuracy": accuracy, "format": form}


def exact_text(response: str, label: str) -> float:
    return float(response.strip() == label.strip())


def char_match(response: str, label: str) -> float:
    """1.0 exactly when the response is the label; a response too long or too short loses the
    characters it lacks or adds. A tiny model's early samples are rarely exactly right: partial
    credit gives GRPO a signal to climb from there."""
    response, label = response.strip(), label.strip()
    hits = sum(a == b for a, b in zip(response, label, strict=False))
    return hits / max(len(response), len(label), 1)
