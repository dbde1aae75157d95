"""`tmx pack` (docs/tp.md): a TrellisMX build laid out per tensor-parallel rank.

The source is test_tp.py's k3src shape (2 layers, 4 experts, moe_intermediate_size 512, 4 KV
heads), quantized at K = 3 with trellis-e4m3, trellis-fp4 and the experimental
trellis-e4m3-pair, so that TP = 2 and TP = 4 cut
every expert into whole 128-wide Hadamard blocks. For each build and tp: the pack passes
--full-closure (every decoded slice equals the unsplit decode bit for bit), its index and rank
manifests are consistent with the source, each rank folder verifies, and `tmx generate --model
OUT --tp N` prints the same greedy text as the build at the same tp (threads, and mpirun when
the build has MPI). A changed or missing source file, a tp that does not split, an OUT holding
another pack and a pack loaded at the wrong tp are refused in one line naming the file; after
one output file is deleted, a rerun writes that file only. An OUT holding files no earlier run
of the pack wrote, and an OUT that is the checkpoint or lies inside it, are refused in one line
naming OUT, and no file is replaced.
"""
import hashlib
import json
import os
import pathlib
import shutil
import struct

import pytest

from test_tp import PROMPT, TMX, generate, make_variant, mpi_build, run

CODECS = ["trellis-e4m3", "trellis-fp4", "trellis-e4m3-pair"]


@pytest.fixture(scope="module")
def builds(tmp_path_factory):
    src = make_variant(tmp_path_factory.mktemp("src"), "bf16", num_key_value_heads=4,
                       num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"],
                       n_routed_experts=4, moe_intermediate_size=512)
    out = {}
    for codec in CODECS:
        d = tmp_path_factory.mktemp("k3") / codec
        run(TMX, "quantize", "--model", src, "--out", str(d), "--codec", codec, "--bits", "3",
            "--threads", "2")
        out[codec] = d
    return out


@pytest.fixture(scope="module")
def packs(builds, tmp_path_factory):
    """(codec, tp) -> (OUT, stdout of `tmx pack --full-closure`)."""
    out = {}
    for codec, build in builds.items():
        for tp in (2, 4):
            d = tmp_path_factory.mktemp("pack") / f"{codec}-tp{tp}"
            r = run(TMX, "pack", "--tp", str(tp), "--full-closure", str(build), str(d))
            out[codec, tp] = (d, r)
    return out


def sha256(path):
    return hashlib.sha256(pathlib.Path(path).read_bytes()).hexdigest()


def header(path):
    """The safetensors header of `path` (name -> {dtype, shape, ...})."""
    raw = pathlib.Path(path).read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n])


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("tp", [2, 4])
def test_pack_layout_manifests_and_closure(builds, packs, codec, tp):
    build = builds[codec]
    out, r = packs[codec, tp]
    # 4 experts x 3 projections per rank, every one compared
    assert f"full closure: {4 * 3 * tp} expert slices decode bit for bit" in r.stdout, r.stdout
    assert "pack" in r.stderr and "100.0%" in r.stderr, r.stderr  # the progress bar
    src_manifest = json.loads((build / "trellismx-manifest.json").read_text())
    index = json.loads((out / "tmx-pack.json").read_text())
    assert index["tp"] == tp and index["codec"] == codec
    assert index["source_manifest_sha256"] == sha256(build / "trellismx-manifest.json")
    assert [x["path"] for x in index["ranks"]] == [f"rank-{i}" for i in range(tp)]
    chunk = src_manifest["layers"][0]["experts"][0]["path"]
    whole = header(build / chunk)
    for rank, entry in enumerate(index["ranks"]):
        rd = out / entry["path"]
        assert entry["manifest_sha256"] == sha256(rd / "trellismx-manifest.json")
        meta = json.loads((rd / "tmx-pack.json").read_text())
        assert (meta["tp"], meta["rank"]) == (tp, rank)
        assert meta["intermediate_rows"] == [512 // tp * rank, 512 // tp * (rank + 1)]
        assert meta["source_manifest_sha256"] == index["source_manifest_sha256"]
        v = run(TMX, "inspect", "--verify", str(rd))
        assert "every file matches trellismx-manifest.json" in v.stdout, v.stdout
        manifest = json.loads((rd / "trellismx-manifest.json").read_text())
        files = {f["path"]: f for f in manifest["files"]}
        for f in src_manifest["files"]:  # everything but the experts is the source's file
            assert f["path"] in files, f["path"]
            if not f["path"].startswith("experts/"):
                assert files[f["path"]]["sha256"] == f["sha256"], f["path"]
        # the ranks rotate alike: the coupled sign vectors are the source's
        assert manifest["layers"][0]["coupled"] == src_manifest["layers"][0]["coupled"]
        cut = header(rd / chunk)
        for p in ("gate_proj", "up_proj"):
            e, rows, cols, w = whole[f"{p}.trellis"]["shape"]
            assert cut[f"{p}.trellis"]["shape"] == [e, rows // tp, cols, w]
        e, rows, cols, w = whole["down_proj.trellis"]["shape"]
        assert cut["down_proj.trellis"]["shape"] == [e, rows, cols // tp, w]
        assert cut["__metadata__"] == whole["__metadata__"]


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("tp", [2, 4])
def test_generate_from_pack_matches_build(builds, packs, codec, tp):
    out, _ = packs[codec, tp]
    ref = generate(str(builds[codec]), "--tp", str(tp), "--threads", "2")
    assert ref.strip()
    assert generate(str(out), "--tp", str(tp), "--threads", "2") == ref


@pytest.mark.skipif(not mpi_build(), reason="no mpirun, or this build of libtmx.so has no MPI")
def test_mpirun_from_pack_matches_build(builds, packs):
    out, _ = packs["trellis-e4m3", 2]
    env = dict(os.environ, OMPI_ALLOW_RUN_AS_ROOT="1", OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
               OMPI_MCA_btl_vader_single_copy_mechanism="none")
    ref = generate(str(builds["trellis-e4m3"]), "--tp", "2", "--threads", "2")
    got = generate(str(out), launcher=("mpirun", "--oversubscribe", "-np", "2"), env=env)
    assert got == ref


def one_line_error(*args):
    r = run(*args, check=False)
    assert r.returncode == 1, (r.returncode, r.stdout, r.stderr)
    lines = r.stderr.strip().split("\n")
    assert len(lines) == 1, r.stderr
    return lines[0]


def test_wrong_or_partial_checkpoint_is_refused(builds, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(builds["trellis-e4m3"], bad)
    chunk = next((bad / "experts").iterdir())
    raw = bytearray(chunk.read_bytes())
    raw[len(raw) // 2] ^= 1
    chunk.write_bytes(bytes(raw))
    msg = one_line_error(TMX, "pack", "-q", "--tp", "2", str(bad), str(tmp_path / "out"))
    assert f"{chunk}: SHA-256 differs from trellismx-manifest.json" in msg
    assert not (tmp_path / "out").exists()  # nothing is written before the source verifies
    coupled = bad / "coupled" / "layer-001.safetensors"
    coupled.unlink()
    msg = one_line_error(TMX, "pack", "-q", "--tp", "2", str(bad), str(tmp_path / "out"))
    assert f"{coupled}: missing" in msg
    msg = one_line_error(TMX, "pack", "-q", "--tp", "8", str(builds["trellis-e4m3"]),
                         str(tmp_path / "out"))
    assert ("config.json: moe_intermediate_size = 512 does not split into tp = 8 slices of "
            "whole 128-wide Hadamard blocks") in msg
    (bad / "trellismx-manifest.json").unlink()
    msg = one_line_error(TMX, "pack", "-q", "--tp", "2", str(bad), str(tmp_path / "out"))
    assert "trellismx-manifest.json: missing; tmx pack reads a TrellisMX build" in msg


def test_pack_loaded_at_another_tp_or_into_another_pack(builds, packs, tmp_path):
    out, _ = packs["trellis-e4m3", 2]
    msg = one_line_error(TMX, "generate", "--model", str(out), "--prompt", PROMPT, "-n", "4",
                         "--tp", "4")
    assert f"{out}/tmx-pack.json: a pack for tp = 2, loaded at tp = 4" in msg
    msg = one_line_error(TMX, "generate", "--model", str(out), "--prompt", PROMPT, "-n", "4")
    assert "a pack for tp = 2, loaded at tp = 1" in msg
    msg = one_line_error(TMX, "generate", "--model", str(out / "rank-1"), "--prompt", PROMPT,
                         "-n", "4", "--tp", "2")
    assert "rank-1/tmx-pack.json holds rank 1 of tp = 2, loaded as rank 0 of tp = 2" in msg
    copy = tmp_path / "copy"
    shutil.copytree(out, copy)
    msg = one_line_error(TMX, "pack", "-q", "--tp", "4", str(builds["trellis-e4m3"]), str(copy))
    assert "holds a pack of another checkpoint or another tp" in msg


def test_rerun_resumes(builds, tmp_path):
    out = tmp_path / "pack"
    run(TMX, "pack", "-q", "--tp", "2", str(builds["trellis-fp4"]), str(out))
    data = [p for p in out.rglob("*") if p.is_file() and p.name not in
            ("tmx-pack.json", "trellismx-manifest.json", "tmx-pack.log")]
    before = {p: (p.stat().st_ino, p.stat().st_mtime_ns, sha256(p)) for p in data}
    lost = out / "rank-1" / "experts" / "layer-001-000-003.safetensors"
    lost.unlink()
    r = run(TMX, "pack", "-q", "--tp", "2", str(builds["trellis-fp4"]), str(out))
    assert f"files written: 1, kept from an earlier run: {len(data) - 1}" in r.stdout, r.stdout
    for p, (ino, mtime, digest) in before.items():
        assert sha256(p) == digest, p
        if p != lost:
            assert (p.stat().st_ino, p.stat().st_mtime_ns) == (ino, mtime), p
    assert not list(out.rglob("*.tmp"))
    v = run(TMX, "inspect", "--verify", str(out / "rank-1"))
    assert "every file matches" in v.stdout
    ref = generate(str(builds["trellis-fp4"]), "--tp", "2", "--threads", "2")
    assert generate(str(out), "--tp", "2", "--threads", "2") == ref


def files(folder):
    return {p: sha256(p) for p in pathlib.Path(folder).rglob("*") if p.is_file()}


def test_out_with_files_of_its_own_is_refused(builds, tmp_path):
    build = str(builds["trellis-e4m3"])
    out = tmp_path / "pc"
    out.mkdir()
    (out / "config.json").write_text("notes\n")
    msg = one_line_error(TMX, "pack", "-q", "--tp", "2", build, str(out))
    assert f"{out}: holds config.json but no tmx-pack.log of an earlier tmx pack" in msg
    assert [p.name for p in out.iterdir()] == ["config.json"]
    assert (out / "config.json").read_text() == "notes\n"
    # an earlier run of this pack: a file added to it is refused and kept
    out = tmp_path / "pack"
    run(TMX, "pack", "-q", "--tp", "2", build, str(out))
    stray = out / "rank-1" / "experts" / "notes.txt"
    stray.write_text("mine")
    before = files(out)
    msg = one_line_error(TMX, "pack", "-q", "--tp", "2", build, str(out))
    assert f"{out}: holds rank-1/experts/notes.txt, which no earlier run of this tmx pack" in msg
    assert files(out) == before
    stray.unlink()
    # a log from before files were claimed in it: a changed copy is not the pack's to replace
    log = out / "tmx-pack.log"
    log.write_text("".join(x for x in log.read_text().splitlines(True)
                           if not x.startswith("writing ")))
    (out / "config.json").unlink()  # a hard link of the rank folders' copies
    (out / "config.json").write_text("notes\n")
    msg = one_line_error(TMX, "pack", "-q", "--tp", "2", build, str(out))
    assert f"{out}: holds config.json, which no earlier run" in msg
    assert (out / "config.json").read_text() == "notes\n"
    # claimed by the log, the same file is the pack's: a rerun writes it again, and leftover
    # temporary files of an interrupted run go
    with open(log, "a") as f:
        f.write("writing config.json\n")
    (out / "rank-0" / "config.json.tmp").write_text("half")
    r = run(TMX, "pack", "-q", "--tp", "2", build, str(out))
    assert "files written: 1," in r.stdout, r.stdout
    assert sha256(out / "config.json") == sha256(builds["trellis-e4m3"] / "config.json")
    assert not list(out.rglob("*.tmp"))
    assert "every file matches" in run(TMX, "inspect", "--verify", str(out / "rank-0")).stdout


def test_out_in_checkpoint_is_refused(builds, tmp_path):
    src = tmp_path / "kB"
    shutil.copytree(builds["trellis-e4m3"], src)
    (tmp_path / "link").symlink_to(src)
    before = files(src)
    for out in (src, src / "experts", src / "new" / "..", tmp_path / "link" / "new"):
        msg = one_line_error(TMX, "pack", "-q", "--tp", "2", str(src), str(out))
        assert f"{out}: OUT is the checkpoint {src} or lies inside it" in msg
    assert files(src) == before
