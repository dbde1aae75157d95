"""`tmx conform` (core/cli/conform.c): the conformance cases of core/conform.c run on a kernel
set from the command line, one line per case, JSON on request, exit status 1 on any failure.

The CPU set is the reference every case passes on, so here the command must report every case
of the table as PASS, write the same results as JSON, honour --filter and --repeat, and fail
cleanly on a filter that matches nothing and on a kernel set that does not exist."""
import json
import os
import re
import subprocess

from tmx_engine import BIN_DIR

TMX = os.path.join(BIN_DIR, "tmx")
LINE = re.compile(r"^(\S+)\s+err\s+(\S+)\s+tol\s+(\S+)\s+(PASS|FAIL)")


def conform(*args):
    return subprocess.run([TMX, "conform", "--set", "threads=2", *args], capture_output=True,
                          text=True, timeout=300)


def case_lines(stdout):
    return [m.groups() for m in map(LINE.match, stdout.splitlines()) if m]


def test_cpu_passes_every_case(tmp_path):
    out = tmp_path / "conform.json"
    r = conform("--kernels", "cpu", "--json", str(out))
    assert r.returncode == 0, r.stderr
    lines = case_lines(r.stdout)
    doc = json.loads(out.read_text())
    assert doc["kernels"] == "cpu"
    assert doc["failed"] == 0
    assert doc["cases_run"] == len(doc["cases"]) == len(lines) > 50
    ops = {c["op"] for c in doc["cases"]}
    assert {"embed", "rmsnorm", "matmul", "rope", "kv_store", "attention", "moe_route",
            "moe_experts", "swiglu", "add_gated", "gather"} <= ops
    for (name, err, tol, verdict), case in zip(lines, doc["cases"]):
        assert verdict == "PASS" and case["pass"] is True and case["status"] == "ok"
        assert case["name"] == name
        assert case["err"] <= case["tol"]
        assert abs(float(err) - case["err"]) <= 1e-3 * case["err"]  # printed to 4 digits
        assert float(tol) == case["tol"]
    assert f"{len(lines)} of {len(lines)} cases pass" in r.stdout


def test_filter_and_repeat(tmp_path):
    out = tmp_path / "matmul.json"
    r = conform("--kernels", "cpu", "--filter", "matmul/bf16", "--repeat", "3", "--json",
                str(out))
    assert r.returncode == 0, r.stderr
    names = [name for name, *_ in case_lines(r.stdout)]
    assert names and all(n.startswith("matmul/bf16/") for n in names)
    doc = json.loads(out.read_text())
    assert [c["name"] for c in doc["cases"]] == names
    assert all(c["us"] > 0 for c in doc["cases"])


def test_no_match_and_unknown_set():
    r = conform("--kernels", "cpu", "--filter", "no-such-case")
    assert r.returncode == 1
    assert 'no case matches "no-such-case"' in r.stderr
    r = conform("--kernels", "no-such-set")
    assert r.returncode == 1
    assert "libtmx-kernels-no-such-set.so not found" in r.stderr
    r = conform("--bogus")
    assert r.returncode == 2
    for bad in ("", "1e3", "-1"):
        r = conform("--repeat", bad)
        want = f'--repeat expects an integer in [0, 1000000], got "{bad}"'
        assert r.returncode == 2 and r.stderr == f"tmx conform: {want}\n"

