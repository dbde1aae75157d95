"""tools/trellis/ncu_source.py reads Nsight Compute's source page as ncu prints it (the
kernel's name above the header, thousands separators) and sums its stall reasons and
shared-memory wavefronts; a report taken without the source counters is a clear error."""
import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[2]
TOOL = REPO / "tools" / "trellis" / "ncu_source.py"

HEADER = ('"Address","Source","Warp Stall Sampling (All Samples)","L1 Wavefronts Shared",'
          '"L1 Wavefronts Shared Excessive","stall_wait","stall_mio","stall_mio (Not Issued)"')
PAGE = "\n".join([
    '"Kernel Name","void k(int)",',
    HEADER,
    '"0x10","LDS.U8 R1, [R2]","30","1,200","900","10","20","5"',
    '"0x20","HGMMA.64x128x16.F32 R24, gdesc[UR8], R24","10","4,000","0","10","10","0"',
    '"0x30","BAR.SYNC 0x0","0","","","0","0","0"',
]) + "\n"


def run(text, *args):
    return subprocess.run([sys.executable, str(TOOL), *args], input=text,
                          capture_output=True, text=True)


def test_sums_stalls_and_wavefronts():
    out = run(PAGE, "--top", "1")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0] == "stalls: mio 60.0%, wait 40.0%"
    assert lines[1] == "shared wavefronts 5200, excess 900 (17%)"
    assert lines[3].split() == ["30", "LDS.U8", "R1,", "[R2]"]
    assert lines[5].split()[:2] == ["4000", "(0)"]


def test_names_the_missing_column():
    out = run('"Address","Source"\n"0x10","NOP"\n')
    assert out.returncode != 0
    assert "Warp Stall Sampling (All Samples)" in out.stderr
