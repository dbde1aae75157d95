"""Shared pytest fixtures: the build's bin folder, libtmx.so through ctypes, ../shared/data."""
import ctypes
import os
import pathlib

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
SHARED_DATA = REPO.parent / "shared" / "data"


@pytest.fixture(scope="session")
def bin_dir():
    """Where libtmx.so, the tmx binary and the plugins are (ctest sets TMX_BIN_DIR)."""
    return pathlib.Path(os.environ.get("TMX_BIN_DIR", "/work/main/build/bin"))


@pytest.fixture(scope="session")
def libtmx(bin_dir):
    path = bin_dir / "libtmx.so"
    if not path.exists():
        raise FileNotFoundError(f"{path} is absent: build first, or set TMX_BIN_DIR")
    return ctypes.CDLL(str(path))


@pytest.fixture(scope="session")
def shared_data():
    """../shared/data, or a skip for the tests that need it."""
    if not SHARED_DATA.is_dir():
        pytest.skip(f"{SHARED_DATA} is absent")
    return SHARED_DATA
