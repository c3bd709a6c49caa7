"""JSONL files of examples, read one way everywhere (SFT, preference pairs, rlhf-launch's data).

for number, record in records("train.jsonl"):    # ValueError names the file and the line
    ...
"""

import json
from collections.abc import Iterator
from pathlib import Path


def records(path: str | Path) -> Iterator[tuple[int, dict]]:
    """Yields (line number, object) for each non-blank line. A line that is not a JSON object
    raises a ValueError naming the file and the line."""
    with open(path, encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise ValueError(f"{path}:{number}: not JSON: {error}") from None
            if not isinstance(record, dict):
                raise ValueError(f"{path}:{number}: expected a JSON object, got {record!r:.60}")
            yield number, record
