"""The chat-template goldens are what Python jinja2 renders today.

tests/unit/test_template.c compares the C renderer with tests/fixtures/templates/*.json; this
checks that those fixtures still come out of tools/template_goldens.py unchanged, so that the
C test never compares against stale expectations.
"""
import pathlib
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures" / "templates"


def test_goldens_are_current(shared_data, tmp_path):
    pytest.importorskip("jinja2")
    subprocess.run([sys.executable, str(REPO / "tools" / "template_goldens.py"),
                    "--templates", str(shared_data / "templates"), "--out", str(tmp_path)],
                   check=True, capture_output=True)
    written = sorted(p.name for p in tmp_path.glob("*.json"))
    assert written == sorted(p.name for p in FIXTURES.glob("*.json"))
    for name in written:
        assert (tmp_path / name).read_bytes() == (FIXTURES / name).read_bytes(), \
            f"{name}: rerun tools/template_goldens.py"
