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
