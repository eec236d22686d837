import os
import tempfile

import pytest
import torch


def pytest_configure(config):
    # compiled kernels go to a cache private to this test session, never the user's
    if "AUTOFP4_KERNEL_CACHE" not in os.environ:
        os.environ["AUTOFP4_KERNEL_CACHE"] = tempfile.mkdtemp(prefix="autofp4-kernels-")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _isolated_db(tmp_path, monkeypatch):
    """Every test gets its own tuning database file, never the user's."""
    monkeypatch.setenv("AUTOFP4_DB", str(tmp_path / "autofp4-test.db"))
    yield


@pytest.fixture
def gen():
    """A fresh random generator per test, seeded from the OS (``gen.initial_seed()`` replays it)."""
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"random seed: {seed}")  # shown by pytest for a failing test
    return torch.Generator().manual_seed(seed)


@pytest.fixture
def one_kernel_cache(tmp_path, monkeypatch):
    """``$AUTOFP4_KERNEL_CACHE`` set to a fresh folder holding one kernel file (bytes ``obj``) and
    its record, as the cache names them; the folder."""
    import json

    kc = tmp_path / "kc"
    kc.mkdir()
    name = "k-" + "0" * 32
    (kc / f"{name}.o").write_bytes(b"obj")
    (kc / f"{name}.json").write_text(json.dumps({"name": "k"}))
    monkeypatch.setenv("AUTOFP4_KERNEL_CACHE", str(kc))
    return kc
