"""`.ci/check_skips.py`: CI fails when a test skips for a reason that is not listed (issue 22.6)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

CHECK = Path(__file__).parent.parent / ".ci" / "check_skips.py"


def report(tmp_path: Path, *skips: str, passed: int = 2) -> Path:
    cases = [f'<testcase classname="t" name="ok{i}"/>' for i in range(passed)]
    cases += [f'<testcase classname="t" name="skip{i}"><skipped message="{m}"/></testcase>' for i, m in enumerate(skips)]
    path = tmp_path / "report.xml"
    path.write_text(f'<testsuites><testsuite name="pytest">{"".join(cases)}</testsuite></testsuites>')
    return path


def check(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(CHECK), str(path)], capture_output=True, text=True, check=False)


def test_listed_skips_pass_and_others_fail(tmp_path: Path) -> None:
    assert check(report(tmp_path, "needs a CUDA GPU with FP8 (compute capability >= 8.9)")).returncode == 0
    failed = check(report(tmp_path, "needs a CUDA GPU with FP8", "could not import 'vllm': No module named 'vllm'"))
    assert failed.returncode == 1
    assert "not an allowed skip: t::skip1: could not import 'vllm'" in failed.stdout


def test_a_run_where_nothing_ran_fails(tmp_path: Path) -> None:
    assert check(report(tmp_path, "needs a CUDA GPU with FP8", passed=0)).returncode == 1
