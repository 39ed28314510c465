"""The suite's two tiers: `pytest` (quick, every module) and `pytest --whole` (what CI runs)."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _collected(*flags):
    r = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *flags],
                       cwd=ROOT, capture_output=True, text=True, timeout=300, check=False)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    return [line.strip() for line in r.stdout.splitlines() if "::" in line]


@pytest.mark.slow  # two collections of the whole suite: 19 s
def test_the_quick_tier_has_tests_of_every_test_module_and_the_whole_suite_has_more():
    quick, whole = _collected(), _collected("--whole")
    modules = sorted(f for f in os.listdir(os.path.join(ROOT, "tests")) if f.startswith("test_") and f.endswith(".py"))
    in_quick = {node.split("::")[0].split("/")[-1] for node in quick}
    assert [m for m in modules if m not in in_quick] == []
    assert set(quick) < set(whole)
    slow = set(whole) - set(quick)
    assert slow == set(_collected("-m", "slow"))


def test_ci_runs_the_whole_suite_the_readme_names():
    with open(os.path.join(ROOT, ".ci", "run"), encoding="utf-8") as f:
        ci = f.read()
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
        readme = f.read()
    assert "\npytest --whole\n" in ci and "\npytest " in readme and "\npytest --whole " in readme
