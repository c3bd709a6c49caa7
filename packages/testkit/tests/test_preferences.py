"""The synthetic reversal task's data: SFT rows, hand-made pairs and pairs on a policy's samples."""

from pathlib import Path

from ferrule_testkit import policy_reversal_pairs, reversal_pairs, reversal_sft_rows
from ferrule_testkit.preferences import in_place

WARM = Path(__file__).parents[3] / "examples" / "tiny" / "model"


def word(prompt: str) -> str:
    return prompt.removeprefix("Reverse the string ").removesuffix(". Answer:")


def test_sft_rows_answer_the_task_and_skip_excluded_prompts():
    first = reversal_sft_rows(200, seed=3)
    assert first == reversal_sft_rows(200, seed=3) != reversal_sft_rows(200, seed=4)
    assert all(row["response"] == " " + word(row["prompt"])[::-1] for row in first)
    excluded = {row["prompt"] for row in first[:50]}
    again = reversal_sft_rows(200, seed=3, exclude=excluded)
    assert len(again) == 200 and not excluded & {row["prompt"] for row in again}


def test_hand_made_pairs_prefer_the_reversal():
    rows = reversal_pairs(100, seed=1)
    assert all(r["chosen"] == " " + word(r["prompt"])[::-1] != r["rejected"] for r in rows)


def test_pairs_on_the_policys_samples_rank_by_letters_in_place():
    excluded = {f"Reverse the string {w}. Answer:" for w in ("abc", "xyz")}
    rows = policy_reversal_pairs(WARM, 96, seed=5, exclude=excluded)
    assert rows == policy_reversal_pairs(WARM, 96, seed=5, exclude=excluded)
    assert len(rows) == 96 and not excluded & {r["prompt"] for r in rows}
    for r in rows:
        answer = " " + word(r["prompt"])[::-1]
        assert in_place(r["chosen"], answer) > in_place(r["rejected"], answer), r
    # some pairs are two of the policy's own samples, neither of them the answer
    assert any(r["chosen"] != " " + word(r["prompt"])[::-1] for r in rows)
