"""Arrays that live on a GPU, from whichever library made them (CuPy, torch, JAX, ...).

A feed is a device array when it exposes `__cuda_array_interface__` or a `__dlpack__`
whose device is CUDA; `as_cupy` wraps it as a CuPy array over the same memory (no copy).
DLPack is preferred: its exchange makes CuPy's current stream wait for the producer's
stream, so a torch tensor still being written is read only once it is ready.
CuPy is imported only when a device array is actually seen.
"""
from __future__ import annotations

import numpy as np

from powerfusion.errors import FeedError

# DLPack device types that are CUDA memory: kDLCUDA, kDLCUDAHost (pinned), kDLCUDAManaged
_DLPACK_CUDA = (2, 3, 13)


def is_device_array(x) -> bool:
    if isinstance(x, np.ndarray):
        return False
    if hasattr(x, "__cuda_array_interface__"):
        return True
    device = getattr(x, "__dlpack_device__", None)
    if device is None:
        return False
    try:
        return int(device()[0]) in _DLPACK_CUDA
    except Exception:   # a producer whose device query fails is treated as a host array
        return False


def as_cupy(x, name: str = "input"):
    """A CuPy array over `x`'s memory, without a copy."""
    try:
        import cupy
    except ImportError:
        raise FeedError(f"{name}: a GPU array was given but CuPy is not installed "
                        "(pip install 'powerfusion[cuda]')") from None
    if isinstance(x, cupy.ndarray):
        return x
    try:
        if hasattr(x, "__dlpack__"):
            return cupy.from_dlpack(x)
        return cupy.asarray(x)
    except Exception as e:   # e.g. a dtype CuPy cannot hold (torch.bfloat16): say which input
        raise FeedError(f"{name}: cannot read this GPU array through DLPack / __cuda_array_interface__ "
                        f"({type(x).__module__}.{type(x).__name__}: {e}); for bfloat16 pass its bits "
                        "as a uint16 array (torch: t.view(torch.int16))") from None


def to_host(x, name: str = "input") -> np.ndarray:
    """A numpy copy of a device array (for a CPU session given GPU feeds)."""
    return as_cupy(x, name).get()
