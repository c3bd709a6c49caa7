"""A reward function for tests/test_gsm8k_example.py: builtin number_match, which fails a
sample whose metadata lacks what the run must send (the source and the row's own "info"
column), so that the run's reward/failed counts any sample sent without it."""

from ferrule_rewards.builtin import number_match

STEPS = {"one_step": "1", "two_step": "2"}  # each source's rows have {"steps": n} as info


def checked_number_match(response: str, label: str, metadata: dict) -> float:
    source = metadata.get("source")
    if source not in STEPS or metadata.get("steps") != STEPS[source]:
        raise ValueError(f"metadata lacks the row's source or info: {metadata}")
    if not metadata.get("sample_id") or not metadata.get("step"):
        raise ValueError(f"metadata lacks the run's keys: {metadata}")
    return number_match(response, label)
