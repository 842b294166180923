"""Page-locked host buffers of exactly the size asked for.

``torch.empty(n, pin_memory=True)`` goes through torch's caching host allocator, which rounds every
request up to the next power of two (and keeps the block cached): an OPT-6.7B block's 0.40 GB
half-precision copy takes 512 MiB of page-locked memory and its 0.81 GB fp32 gradient 1 GiB, 27%
more than the stores hold -- memory that can neither be swapped out nor used by anything else, and
that a host-memory check counting bytes per parameter does not see. The stores' buffers are instead
allocated at their exact size in page-aligned anonymous mappings and page-locked in place with
``cudaHostRegister``: copies from and to them are DMA transfers as from ``pin_memory`` tensors. The
registration ends (``cudaHostUnregister``) when the buffer's owner is collected; the memory is
freed after that, once the last view of it is gone.

Where registration is refused (no CUDA, an old driver, a virtualised host), :func:`host_zeros`
falls back to torch's pinned allocator for the rest of the process and says so once.
"""

from __future__ import annotations

import ctypes
import logging
import mmap
import weakref

import torch

log = logging.getLogger(__name__)

_PORTABLE = 1  # cudaHostRegisterPortable: page-locked for every CUDA context of the process
_state = {"register": True}  # False once a registration failed: torch's pinned allocator from then on


def host_zeros(numel: int, dtype: torch.dtype, pin: bool, owner: object | None = None) -> torch.Tensor:
    """A zeroed host tensor of ``numel`` elements; with ``pin`` page-locked at its exact size for as
    long as ``owner`` lives (``owner`` is required with ``pin``)."""
    if not pin or numel == 0:
        return torch.zeros(numel, dtype=dtype)
    assert owner is not None, "a registered buffer is unregistered with its owner"
    if _state["register"]:
        t = _page_aligned_zeros(numel, dtype)
        if register(t):
            done = weakref.finalize(owner, unregister, t)  # holds t: the memory outlives its registration
            done.atexit = False  # at exit the process's teardown unpins everything at once
            return t
    return _torch_pinned(torch.zeros(numel, dtype=dtype))


def _page_aligned_zeros(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """Zeros in an anonymous mapping of their own (page-aligned: no page shared with other data); the
    tensor keeps the mapping alive."""
    return torch.frombuffer(mmap.mmap(-1, numel * dtype.itemsize), dtype=dtype, count=numel)


def _torch_pinned(t: torch.Tensor) -> torch.Tensor:
    """The fallback: a copy in torch's pinned allocator (rounded up to a power of two)."""
    return t.pin_memory()


def register(t: torch.Tensor) -> bool:
    """Page-lock ``t``'s memory where it is (True), or say why not once and return False."""
    nbytes = t.numel() * t.element_size()
    try:
        err = int(torch.cuda.cudart().cudaHostRegister(t.data_ptr(), nbytes, _PORTABLE))
    except Exception as e:  # no CUDA build, runtime binding or device: a capability probe, nothing to lose
        return _give_up(f"cudaHostRegister is not available ({e})")
    if err != 0:
        _clear_cuda_error()
        return _give_up(f"cudaHostRegister of {nbytes / 2**20:.0f} MiB failed with CUDA error {err}")
    return True


def unregister(t: torch.Tensor) -> None:
    try:
        if int(torch.cuda.cudart().cudaHostUnregister(t.data_ptr())) != 0:
            _clear_cuda_error()
    except Exception as e:  # best effort, from the garbage collector: the process unpins at exit anyway
        log.debug("cudaHostUnregister failed: %s", e)


def _give_up(why: str) -> bool:
    _state["register"] = False
    log.warning("%s: host buffers fall back to torch's pinned allocator, which rounds each one up to a power of "
                "two (up to twice the page-locked memory the plan counts)", why)
    return False


def _clear_cuda_error() -> None:
    """Reset the CUDA runtime's last error, so that torch's next launch check does not report ours."""
    rt = torch.cuda.cudart()
    if hasattr(rt, "cudaGetLastError"):
        rt.cudaGetLastError()
        return
    lib = _loaded_cudart()
    if lib is not None:
        lib.cudaGetLastError()


def _loaded_cudart() -> ctypes.CDLL | None:
    """The CUDA runtime library this process has loaded (the one torch uses), or None."""
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "libcudart.so" in line}
    except OSError:
        return None
    return ctypes.CDLL(sorted(paths)[0]) if paths else None
