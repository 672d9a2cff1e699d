"""A header-only GGUF file of a given architecture."""
import numpy as np


def write_gguf(path, arch):
    """A header-only GGUF of the given architecture (one dummy tensor): enough for the checks that run
    before any weight is read."""
    import gguf

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_tensor("dummy", np.zeros(4, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
