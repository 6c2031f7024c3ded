"""The torch adapter's pointer-made CuPy views of CUDA tensors
(``arrays.stream_view``) against DLPack's (``tensor_as_array``): the same
memory, shape, dtype and values for every dtype the adapter passes on,
writes through the view land in the tensor, and the view keeps the tensor's
memory alive after the caller drops it.

Skipped (with the reason) unless torch sees a CUDA device and CuPy works.
"""
import gc

import numpy as np
import pytest

from dynamiq_mpi.cuda import has_cuda, why_not

torch = pytest.importorskip("torch")

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not (has_cuda() and torch.cuda.is_available()),
                                 reason=f"no CUDA: {why_not() if not has_cuda() else 'torch'}")]

if has_cuda() and torch.cuda.is_available():  # pragma: no branch
    import cupy as cp

    from dynamiq_mpi.torch.arrays import stream_view, tensor_as_array, torch_stream

DTYPES = ["float32", "float16", "bfloat16", "float64", "int32", "uint8"]


def _tensor(dtype, shape, seed):
    g = torch.Generator(device="cpu").manual_seed(seed)
    t = torch.randn(shape, generator=g, dtype=torch.float64) * 100
    return t.to(getattr(torch, dtype)).cuda()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1000,), (7, 33), (3, 4, 5)], ids=str)
def test_pointer_view_equals_dlpack_view(dtype, shape):
    seed = int(np.random.SeedSequence().entropy % 2**31)
    t = _tensor(dtype, shape, seed)
    with torch_stream(t.device):
        first = stream_view(t)             # the first of a dtype learns it from DLPack
        view = stream_view(t)
        ref = tensor_as_array(t)
    for a in (first, view):
        assert a.data.ptr == t.data_ptr() == ref.data.ptr
        assert a.shape == ref.shape == tuple(shape)
        assert a.dtype == ref.dtype and a.strides == ref.strides
        assert cp.array_equal(a.view(np.uint8), ref.view(np.uint8))
    view.ravel()[5] = ref.dtype.type(3)
    torch.cuda.synchronize()
    assert float(t.reshape(-1)[5]) == 3.0


def test_a_slice_at_an_offset_and_an_empty_tensor():
    base = _tensor("float32", (100,), 1)
    part = base[10:30]
    with torch_stream(base.device):
        v = stream_view(part)
        e = stream_view(base[:0])
    assert v.data.ptr == part.data_ptr() and v.shape == (20,)
    assert cp.array_equal(v, cp.asarray(tensor_as_array(base))[10:30])
    assert e.shape == (0,)
    with pytest.raises(ValueError, match="contiguous"):
        stream_view(base.reshape(10, 10).t())


def test_the_view_keeps_the_tensor_alive():
    t = _tensor("float32", (1 << 20,), 2)
    expect = t.double().cpu().numpy()
    with torch_stream(t.device):
        view = stream_view(t)
    del t
    gc.collect()
    junk = [torch.full((1 << 20,), 7.0, device="cuda") for _ in range(8)]  # would reuse freed memory
    torch.cuda.synchronize()
    assert np.array_equal(cp.asnumpy(view).astype(np.float64), expect)
    del junk
