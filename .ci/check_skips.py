"""Fail CI when a test skipped for a reason not listed in .ci/allowed-skips.txt, or nothing ran.

    python .ci/check_skips.py REPORT.xml   (pytest's --junitxml report)
"""

from __future__ import annotations

import re
import sys
import xml.etree.ElementTree as ET
from pathlib import Path


def main(report: str) -> int:
    allowed = [
        re.compile(line.strip())
        for line in (Path(__file__).parent / "allowed-skips.txt").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    cases = list(ET.parse(report).getroot().iter("testcase"))
    skipped = [(case, case.find("skipped")) for case in cases if case.find("skipped") is not None]
    unexpected = [
        f"{case.get('classname')}::{case.get('name')}: {skip.get('message', '')}"
        for case, skip in skipped
        if not any(pattern.search(skip.get("message", "")) for pattern in allowed)
    ]
    ran = len(cases) - len(skipped)
    print(f"check_skips: {len(cases)} tests, {ran} ran, {len(skipped)} skipped ({len(skipped) - len(unexpected)} allowed)")
    for line in unexpected:
        print(f"check_skips: not an allowed skip: {line}")
    if unexpected or ran == 0:
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
