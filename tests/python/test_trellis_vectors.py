"""The TrellisMX test vectors in tests/fixtures/trellismx are what tools/trellis/make_vectors.py
computes from docs/trellismx.md: a change to the spec's rules, the generator or the files shows
here (the C library is checked against the files by tests/unit/test_trellis.c)."""
import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures" / "trellismx"


def test_vectors_are_regenerated(tmp_path):
    subprocess.run([sys.executable, str(REPO / "tools" / "trellis" / "make_vectors.py"),
                    "--out", str(tmp_path)], check=True)
    made = sorted(p.name for p in tmp_path.iterdir())
    assert made == sorted(p.name for p in FIXTURES.iterdir())
    for name in made:
        assert (tmp_path / name).read_bytes() == (FIXTURES / name).read_bytes(), name


def test_spec_quotes_the_tables():
    out = subprocess.run([sys.executable, str(REPO / "tools" / "trellis" / "make_vectors.py"),
                          "--markdown"], check=True, capture_output=True, text=True).stdout
    spec = (REPO / "docs" / "trellismx.md").read_text()
    blocks = out.split("```")[1::2]
    assert len(blocks) == 3  # LUT_E4M3, LUT_E2M1, law e4m3-pair's Q
    for block in blocks:
        assert block.strip() in spec
    for line in out.splitlines():
        if line.startswith(("SHA-256", "FNV-1a 64")):
            assert line.split("`")[1] in spec
