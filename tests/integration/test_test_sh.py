"""launch/test.sh's verdict over its tiers, on a copy of the script beside three tiny tiers (SKIP_SETUP=1:
the venv as it is; setup.sh would reinstall it): a filter that matches nothing in any tier fails the whole
suite, a tier that matches nothing beside one that ran passes, a failing tier fails it."""
import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TIERS = {"unit": "def test_alpha():\n    pass\n",
         "integration": "def test_beta():\n    pass\n",
         "system": "def test_gamma():\n    assert False, 'gamma fails'\n"}


@pytest.fixture(scope="module")
def suite(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("suite")
    (root / "launch").mkdir()
    shutil.copy(ROOT / "launch" / "test.sh", root / "launch" / "test.sh")
    (root / ".venv").symlink_to((ROOT / ".venv").resolve())
    for tier, body in TIERS.items():
        (root / "tests" / tier).mkdir(parents=True)
        (root / "tests" / tier / f"test_{tier}.py").write_text(body)
    return root


def run_suite(suite: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "SKIP_SETUP": "1", "PYTEST_WORKERS": "0"}
    env.pop("PYTHONPATH", None)  # the tiny tiers import nothing of the project
    return subprocess.run(["bash", str(suite / "launch" / "test.sh"), *args, "-p", "no:cacheprovider"], env=env,
                          capture_output=True, text=True, timeout=600)


def test_a_filter_matching_nothing_anywhere_fails_the_suite(suite):
    r = run_suite(suite, "-k", "no_such_test_anywhere")
    assert r.returncode == 5, r.stdout + r.stderr
    assert "no tier ran a test" in r.stderr


def test_tiers_matching_nothing_pass_beside_one_that_ran(suite):
    r = run_suite(suite, "-k", "alpha or beta")
    assert r.returncode == 0, r.stdout + r.stderr


def test_a_failing_tier_fails_the_suite(suite):
    r = run_suite(suite, "-k", "alpha or gamma")
    assert r.returncode == 1 and "failed tiers: system" in r.stderr, r.stdout + r.stderr


def test_one_tier_matching_nothing_fails(suite):
    assert run_suite(suite, "unit", "-k", "beta").returncode == 5
