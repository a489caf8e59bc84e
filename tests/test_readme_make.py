"""README's ``make gpu-test`` line states what the Makefile runs: ``-m "not slow"`` is ``PYTEST_ARGS``' default,
which a user's own ``PYTEST_ARGS`` replaces, and the README says so."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_readme_names_pytest_args_default_as_the_makefile_sets_it():
    make = (ROOT / "Makefile").read_text()
    default = re.search(r"^PYTEST_ARGS \?= (.+)$", make, re.M).group(1).strip()
    recipe = re.search(r"^gpu-test:.*?\n\t.*?\n\t(.+)$", make, re.M).group(1)
    assert recipe.endswith("$(PYTEST_ARGS)"), recipe
    readme = (ROOT / "README.md").read_text()
    line = next(x for x in readme.splitlines() if x.startswith("make gpu-test"))
    assert line.rstrip().endswith("$(PYTEST_ARGS)"), line  # not the default spelled out as if always passed
    assert f"`PYTEST_ARGS` defaults to `{default}`; setting it replaces that default" in readme
