# cython: language_level=3, boundscheck=False, wraparound=False
"""Thin wrappers of the CUDA codec kernels (src_cuda/dq_kernels.cu).

The same Python API as ``dynamiq_mpi._cpu`` (same functions, same argument
order), on CuPy arrays: device pointers come from ``array.data.ptr`` (no
copies), every kernel is enqueued on CuPy's current stream (or ``stream=``, a
``cupy.cuda.Stream`` or a raw handle), and nothing synchronises.  Every launch
is checked; a failure raises ``RuntimeError`` with the CUDA error string.

Differences from ``_cpu``: ``stats`` returns its non-finite count as a 0-d
CuPy int64 array (``int(bad)`` synchronises; ``bad != 0`` works on both), and
the baselines ``bf16_*`` / ``exact_*`` exist here only.

Importing never needs a GPU or a driver (the CUDA runtime is linked
statically); ``is_usable()`` says whether kernels can run.
"""
from libc.stdint cimport int64_t, uint32_t, uint8_t, int32_t, uint16_t, uintptr_t

import numpy as np
cimport numpy as cnp

cnp.import_array()

from libc.stdint cimport int8_t
from libc.stddef cimport size_t
from dq_codec cimport (DQ_PLAN_HEADER, DQ_SUPER, DQ_TILE_INTS, DqParams, DqPlanArgs, DqSource,
                      check_bytes, check_event, check_layout, fill_plan_args, piece_in,
                      piece_params, raw_piece, shifted_source, wire_bytes)

cdef extern from "dq_gpu_api.h":
    int dq_gpu_device_count(int* count) nogil
    const char* dq_gpu_error_string(int code) nogil
    const char* dq_gpu_error_name(int code) nogil
    int dq_gpu_ensure_device(int device) nogil
    int dq_gpu_device_name(int device, char* buf, int buflen) nogil
    int dq_gpu_synchronize(uintptr_t stream) nogil
    int dq_gpu_last_error() nogil
    void dq_gpu_set_variant(int variant) nogil
    void dq_gpu_set_encode_grid(int blocks) nogil
    int dq_gpu_set_keys(uint32_t* dst, uint32_t key_value, uint32_t key_perm,
                        uintptr_t stream) nogil
    int dq_gpu_stats(const DqSource* S, int64_t nsg, int centre, float* mean, float* norm2,
                     int64_t* nonfinite, float* tail, uintptr_t stream) nogil
    int dq_gpu_compress(const DqParams* P, const DqSource* local, int64_t nsg, int64_t sg_base,
                        uint32_t event, uint8_t* out, uintptr_t stream,
                        const int64_t* piece) nogil
    int dq_gpu_decompress(const DqParams* P, const uint8_t* inp, int64_t nsg, float* out,
                          int accumulate, uintptr_t stream, const int64_t* piece) nogil
    int dq_gpu_dar(const DqParams* P, const uint8_t* inp, const DqSource* local, int64_t nsg,
                   int64_t sg_base, uint32_t event, uint8_t* out, uintptr_t stream,
                   const int64_t* piece) nogil
    int dq_gpu_finish(const float* stream_values, const int64_t* stream_of_sg,
                      const float* mean_sum, int64_t nsg, float divisor, void* out, int dtype,
                      int64_t length, uintptr_t stream, const double* refuse, float limit) nogil
    int dq_gpu_decompress_out(const DqParams* P, const uint8_t* inp, int64_t nsg, int64_t sg_base,
                              const int64_t* order, const float* mean_sum, float divisor,
                              void* out, int dtype, int64_t length, uintptr_t stream,
                              const int64_t* piece) nogil
    int dq_gpu_bf16_decompress_out(const uint16_t* inp, int64_t nsg, int64_t sg_base,
                                   const int64_t* order, const float* mean_sum, float divisor,
                                   void* out, int dtype, int64_t length, uintptr_t stream,
                                   const int64_t* piece) nogil
    int dq_gpu_bf16_compress(const DqSource* local, int64_t nsg, int64_t n, uint16_t* out,
                             uintptr_t stream, const int64_t* piece) nogil
    int dq_gpu_bf16_decompress(const uint16_t* inp, int64_t n, float* out, int accumulate,
                               uintptr_t stream, const int64_t* piece) nogil
    int dq_gpu_bf16_dar(const uint16_t* inp, const DqSource* local, int64_t nsg, int64_t n,
                        uint16_t* out, uintptr_t stream, const int64_t* piece) nogil
    int dq_gpu_exact_compress(const DqSource* local, int64_t nsg, int64_t n, float* out,
                              uintptr_t stream, const int64_t* piece) nogil
    int dq_gpu_exact_decompress(const float* inp, int64_t n, float* out, int accumulate,
                                uintptr_t stream) nogil
    int dq_gpu_exact_dar(const float* inp, const DqSource* local, int64_t nsg, int64_t n,
                         float* out, uintptr_t stream) nogil

cdef extern from "mx_api.h":
    ctypedef struct DqMxFormat:
        int32_t bits, mbits, bias
        float max_normal
    int dq_gpu_mx_stats(const DqSource* S, int64_t nblocks, uint8_t* out, uintptr_t stream) nogil
    int dq_gpu_mx_encode(DqMxFormat f, const uint8_t* reduced, int32_t headroom,
                         const DqSource* local, int64_t elem_base, const uint8_t* inp,
                         int64_t nblocks, uint8_t* out, uintptr_t stream) nogil
    int dq_gpu_mx_decode(DqMxFormat f, const uint8_t* reduced, int32_t headroom,
                         const uint8_t* inp, int64_t nblocks, const DqSource* local,
                         int64_t elem_base, float* out, int accumulate, uintptr_t stream) nogil

cdef extern from "dq_plan_api.h":
    size_t dq_gpu_plan_scratch_bytes(int64_t nsg) nogil
    int dq_gpu_plan_pieces(double* header, int64_t n, int64_t T, const int64_t* rb, int64_t cap,
                           int64_t* table, uint8_t* wire, uintptr_t stream) nogil
    int dq_gpu_plan(const DqPlanArgs* A, const float* norm2, const float* mean_sum,
                    const float* tail, int8_t* widths, int64_t* order, int64_t* stream_of_sg,
                    double* header, void* scratch, size_t scratch_bytes, uintptr_t stream) nogil

SUPER = 256
PARAMS_SIZE = sizeof(DqParams)
PLAN_HEADER = DQ_PLAN_HEADER
TILE_INTS = DQ_TILE_INTS

# ------------------------------------------------------------------ device state

def device_count():
    """Number of CUDA devices; 0 (never an exception) without a driver or GPU."""
    cdef int n = 0
    cdef int rc
    with nogil:
        rc = dq_gpu_device_count(&n)
    return n if rc == 0 else 0


def is_usable():
    """True when a CUDA device can run the kernels (never raises)."""
    try:
        return device_count() > 0
    except Exception:  # pragma: no cover - belt and braces
        return False


def error_string(int code):
    return "%s: %s" % (dq_gpu_error_name(code).decode(), dq_gpu_error_string(code).decode())


cdef int _check(int rc, what) except -1:
    if rc != 0:
        msg = error_string(rc)
        if rc == 1:  # cudaErrorInvalidValue
            msg += " (bad arguments or codec parameters the kernels cannot reproduce)"
        raise RuntimeError("dynamiq_mpi._gpu.%s failed: CUDA error %d (%s)" % (what, rc, msg))
    return 0


def device_name(int device=0):
    cdef char buf[256]
    _check(dq_gpu_device_name(device, buf, 256), "device_name")
    return buf.decode()


def synchronize(stream=None):
    """cudaStreamSynchronize on ``stream`` (default: CuPy's current stream)."""
    cdef uintptr_t st = _stream(stream)
    cdef int rc
    with nogil:
        rc = dq_gpu_synchronize(st)
    _check(rc, "synchronize")


def set_encode_grid(int blocks):
    """Tests only: at most `blocks` blocks per encoder launch (0 restores the
    resident grid), so small inputs exercise many grid-stride steps per warp."""
    dq_gpu_set_encode_grid(blocks)


def set_variant(int variant):
    """Timing studies only: 1 selects a one-round hash in the 4-bit encoders
    (NOT bit-identical to the CPU).  0 (the default) is the real codec."""
    dq_gpu_set_variant(variant)


_cupy = None

cdef object _cp():
    global _cupy
    if _cupy is None:
        import cupy
        _cupy = cupy
    return _cupy


cdef uintptr_t _stream(stream) except? 0:
    if stream is None:
        return <uintptr_t>_cp().cuda.get_current_stream().ptr
    if isinstance(stream, int):
        return <uintptr_t>stream
    return <uintptr_t>stream.ptr


cdef uintptr_t _dptr(a, what) except? 0:
    """Device pointer of a flat C-contiguous CuPy array (also selects its device)."""
    try:
        mem = a.data
        ptr = mem.ptr
    except AttributeError:
        raise TypeError("%s must be a CuPy array, got %s" % (what, type(a).__name__)) from None
    if a.ndim != 1 or not a.flags.c_contiguous:
        raise ValueError("%s must be flat and C-contiguous" % what)
    _check(dq_gpu_ensure_device(mem.device_id), "set device")
    return <uintptr_t>ptr


cdef int _dtype_code(a, what) except -1:
    dt = a.dtype
    if dt == np.float32:
        return 0
    if dt.itemsize == 2 and dt.name == "bfloat16":
        return 1
    raise TypeError("%s: unsupported dtype %s (float32 or bfloat16)" % (what, dt))


cdef int _expect(a, dtype, int64_t size, what) except -1:
    if a.dtype != dtype:
        raise TypeError("%s must be %s, got %s" % (what, np.dtype(dtype), a.dtype))
    if size >= 0 and a.size != size:
        raise ValueError("%s: expected %d elements, got %d" % (what, size, a.size))
    return 0


# ------------------------------------------------------------------ params

# The DqParams blob is the same struct for both paths: one builder, in _cpu.
from dynamiq_mpi._cpu import PARAMS_KEY_PTR_AT, PARAMS_KEYS_AT, make_params  # noqa: E402


cdef const DqParams* _params(const uint8_t[::1] blob) except NULL:
    if blob.shape[0] != sizeof(DqParams):
        raise ValueError("params blob has the wrong size")
    return <const DqParams*>&blob[0]


def run_bytes(int64_t nsg, int width, bint hierarchical):
    return wire_bytes(nsg, width, 1 if hierarchical else 0)


# ------------------------------------------------------------------ sources

cdef class Source:
    """Where local values come from: a flat float32/bfloat16 CuPy array read by
    super-group through an optional map, minus optional per-row means (the
    device pointers of dq_codec.h's DqSource).  NumPy sg_map / mean are copied
    to the device once."""
    cdef DqSource src
    cdef object _keep

    def __cinit__(self, x, sg_map=None, int64_t sg_offset=0, mean=None):
        self.src.dtype = _dtype_code(x, "source")
        self.src.x = <const void*>_dptr(x, "source")
        self.src.length = x.size
        self.src.sg_offset = sg_offset
        self.src.sg_map = NULL
        self.src.mean = NULL
        keep = [x]
        cp = None
        if sg_map is not None:
            cp = _cp()
            m = cp.ascontiguousarray(cp.asarray(sg_map), dtype=cp.int64).reshape(-1)
            self.src.sg_map = <const int64_t*>_dptr(m, "sg_map")
            keep.append(m)
        if mean is not None:
            cp = _cp()
            m = cp.ascontiguousarray(cp.asarray(mean), dtype=cp.float32).reshape(-1)
            self.src.mean = <const float*>_dptr(m, "mean")
            keep.append(m)
        self._keep = keep

    @property
    def length(self):
        return self.src.length


# ------------------------------------------------------------------ the parts
# One module, its functions in files named for their seam.
include "gpu_codec.pxi"
include "gpu_baselines.pxi"
include "gpu_layout.pxi"
