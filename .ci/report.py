"""The end of a CI run: each stage's seconds, then the slowest tests of every pytest run.

python3 .ci/report.py STAGES.tsv JUNIT_DIR TOTAL_SECONDS EXIT_STATUS
"""

import sys
import xml.etree.ElementTree as ET
from pathlib import Path

SLOWEST = 25

stages, junit, total, status = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
print(f"\n==> CI {'passed' if status == 0 else f'FAILED (status {status})'} in {total}s")
print(f"\n{'seconds':>8}  stage")
for line in Path(stages).read_text().splitlines():
    seconds, name = line.split("\t", 1)
    print(f"{seconds:>8}  {name}")

tests = []
for path in sorted(junit.glob("*.xml")):
    for case in ET.parse(path).iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        tests.append((float(case.get("time") or 0), path.stem, name))
if tests:
    print(f"\nThe {min(SLOWEST, len(tests))} slowest of {len(tests)} tests:")
    print(f"{'seconds':>8}  {'run':<20} test")
    for seconds, run, name in sorted(tests, reverse=True)[:SLOWEST]:
        print(f"{seconds:>8.1f}  {run:<20} {name}")
