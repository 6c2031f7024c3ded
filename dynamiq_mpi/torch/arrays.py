"""Torch tensors as the collective's arrays: zero-copy NumPy views of CPU
tensors and CuPy views of CUDA tensors, and torch's current stream made
CuPy's for the duration of a call (so the hand-over needs no device
synchronisation)."""
import contextlib

import torch


def tensor_as_array(t: torch.Tensor):
    """A NumPy (CPU) or CuPy (CUDA) array sharing ``t``'s memory.

    CUDA tensors go through DLPack under CuPy's *current* stream: call this
    inside :func:`torch_stream` so that CuPy's stream is torch's and the
    hand-over needs no synchronisation.
    """
    t = t.detach()
    if not t.is_contiguous():
        raise ValueError("dynamiq_mpi.torch: the tensor must be contiguous")
    if t.device.type == "cpu":
        if t.dtype == torch.bfloat16:
            # NumPy has no bfloat16: reinterpret the bits as ml_dtypes.bfloat16.
            import ml_dtypes
            return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
        return t.numpy()
    if t.device.type == "cuda":
        import cupy
        return cupy.from_dlpack(t)
    raise TypeError(f"dynamiq_mpi.torch: tensors on {t.device.type!r} are not supported "
                    "(cpu and cuda are)")


_CUPY_DTYPES: dict = {}      # torch dtype -> the CuPy dtype DLPack gives its tensors


def stream_view(t: torch.Tensor):
    """:func:`tensor_as_array` for use under :func:`torch_stream`: a CUDA
    tensor's CuPy view is made from its pointer, since DLPack's hand-over (a
    capsule, torch's stream bookkeeping) costs several times more host time
    and on one stream orders nothing.  The view keeps ``t`` alive; its dtype
    is the one DLPack gives (learnt on the first tensor of a dtype), so both
    ways agree."""
    if t.device.type != "cuda":
        return tensor_as_array(t)
    import cupy
    dtype = _CUPY_DTYPES.get(t.dtype)
    if dtype is None or t.numel() == 0:
        arr = tensor_as_array(t)
        _CUPY_DTYPES[t.dtype] = arr.dtype
        return arr
    if not t.is_contiguous():
        raise ValueError("dynamiq_mpi.torch: the tensor must be contiguous")
    mem = cupy.cuda.UnownedMemory(t.data_ptr(), t.numel() * t.element_size(), t,
                                  t.device.index)
    return cupy.ndarray(tuple(t.shape), dtype, cupy.cuda.MemoryPointer(mem, 0))


@contextlib.contextmanager
def torch_stream(device: torch.device):
    """Make torch's current stream of ``device`` CuPy's current stream (and
    the device current) for the duration; a no-op for CPU tensors."""
    if device.type != "cuda":
        yield
        return
    import cupy
    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = torch.cuda.current_stream(index)
    with cupy.cuda.Device(index), cupy.cuda.ExternalStream(stream.cuda_stream, index):
        yield
