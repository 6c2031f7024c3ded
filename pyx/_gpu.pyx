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


# ------------------------------------------------------------------ DynamiQ codec

def stats(x, int64_t nsg, bint centre, stream=None):
    """Per super-group (mean, squared norm of centred values) of the first nsg
    super-groups of x (zero-padded) as CuPy float32 arrays, and the count of
    non-finite inputs as a 0-d CuPy int64 array."""
    cp = _cp()
    cdef Source s = Source(x)
    if nsg * SUPER < x.size:
        raise ValueError("stats: %d super-groups do not cover %d values" % (nsg, x.size))
    mean = cp.empty(nsg, cp.float32)
    norm2 = cp.empty(nsg, cp.float32)
    bad = cp.zeros((), cp.int64)
    cdef uintptr_t st = _stream(stream)
    cdef float* mp = <float*>(<uintptr_t>mean.data.ptr)
    cdef float* np_ = <float*>(<uintptr_t>norm2.data.ptr)
    cdef int64_t* bp = <int64_t*>(<uintptr_t>bad.data.ptr)
    cdef int rc
    with nogil:
        rc = dq_gpu_stats(&s.src, nsg, 1 if centre else 0, mp, np_, bp, NULL, st)
    _check(rc, "stats")
    return mean, norm2, bad


def stats_into(x, int64_t nsg, bint centre, mean, norm2, tail, scratch, stream=None):
    """stats() written into caller CuPy buffers (see _cpu.stats_into); ``scratch``
    is one int64 device word for the non-finite count."""
    cdef Source s = Source(x)
    if nsg * SUPER < x.size:
        raise ValueError("stats: %d super-groups do not cover %d values" % (nsg, x.size))
    _expect(norm2, np.float32, nsg, "stats norm2")
    _expect(tail, np.float32, 2, "stats tail")
    _expect(scratch, np.int64, 1, "stats scratch")
    cdef float* mp = NULL
    if mean is not None:
        _expect(mean, np.float32, nsg, "stats mean")
        if nsg:
            mp = <float*>_dptr(mean, "stats mean")
    elif centre:
        raise ValueError("stats_into: centring needs a mean buffer")
    cdef float* np_ = <float*>_dptr(norm2, "stats norm2") if nsg else NULL
    cdef float* tp = <float*>_dptr(tail, "stats tail")
    cdef int64_t* bp = <int64_t*>_dptr(scratch, "stats scratch")
    cdef uintptr_t st = _stream(stream)
    cdef int rc
    with nogil:
        rc = dq_gpu_stats(&s.src, nsg, 1 if centre else 0, mp, np_, bp, tp, st)
    _check(rc, "stats")


def compress(const uint8_t[::1] params, Source local, int64_t nsg, int64_t sg_base,
             unsigned event, out, stream=None):
    cdef const DqParams* P = _params(params)
    _expect(out, np.uint8, -1, "compress out")
    check_bytes(nsg, out.size, P)
    check_event(event, P)
    if nsg == 0:
        return
    cdef uint8_t* op = <uint8_t*>_dptr(out, "compress out")
    cdef uintptr_t st = _stream(stream)
    cdef int rc
    with nogil:
        rc = dq_gpu_compress(P, &local.src, nsg, sg_base, event, op, st, NULL)
    _check(rc, "compress")


def decompress(const uint8_t[::1] params, inp, int64_t nsg, out, bint accumulate, stream=None):
    cdef const DqParams* P = _params(params)
    _expect(inp, np.uint8, -1, "decompress input")
    check_bytes(nsg, inp.size, P)
    _expect(out, np.float32, nsg * SUPER, "decompress out")
    if nsg == 0:
        return
    cdef const uint8_t* ip = <const uint8_t*>_dptr(inp, "decompress input")
    cdef float* op = <float*>_dptr(out, "decompress out")
    cdef uintptr_t st = _stream(stream)
    cdef int rc
    with nogil:
        rc = dq_gpu_decompress(P, ip, nsg, op, 1 if accumulate else 0, st, NULL)
    _check(rc, "decompress")


def dar(const uint8_t[::1] params, inp, Source local, int64_t nsg, int64_t sg_base,
        unsigned event, out, stream=None):
    """out = compress(decompress(inp) + local) in one pass (inp may be out)."""
    cdef const DqParams* P = _params(params)
    _expect(inp, np.uint8, -1, "dar input")
    _expect(out, np.uint8, -1, "dar out")
    check_bytes(nsg, inp.size, P)
    check_bytes(nsg, out.size, P)
    check_event(event, P)
    if nsg == 0:
        return
    cdef const uint8_t* ip = <const uint8_t*>_dptr(inp, "dar input")
    cdef uint8_t* op = <uint8_t*>_dptr(out, "dar out")
    cdef uintptr_t st = _stream(stream)
    cdef int rc
    with nogil:
        rc = dq_gpu_dar(P, ip, &local.src, nsg, sg_base, event, op, st, NULL)
    _check(rc, "dar")


def decompress_out(const uint8_t[::1] params, inp, int64_t nsg, int64_t sg_base, order,
                   mean_sum, float divisor, out, stream=None):
    """Decompress stream super-groups sg_base .. sg_base + nsg straight into the
    caller's layout: what decompress then finish would write for them."""
    cdef const DqParams* P = _params(params)
    cdef int dtype = _dtype_code(out, "decompress_out out")
    _expect(inp, np.uint8, -1, "decompress_out input")
    check_bytes(nsg, inp.size, P)
    _expect(order, np.int64, -1, "decompress_out order")
    _expect(mean_sum, np.float32, -1, "decompress_out mean_sum")
    if sg_base < 0 or sg_base + nsg > order.size:
        raise ValueError("decompress_out: stream super-groups beyond the order map")
    if mean_sum.size * SUPER < out.size:
        raise ValueError("decompress_out: mean_sum does not cover the output")
    if nsg == 0 or out.size == 0:
        return
    cdef const uint8_t* ip = <const uint8_t*>_dptr(inp, "decompress_out input")
    cdef const int64_t* gp = <const int64_t*>_dptr(order, "decompress_out order")
    cdef const float* mp = <const float*>_dptr(mean_sum, "decompress_out mean_sum")
    cdef void* op = <void*>_dptr(out, "decompress_out out")
    cdef int64_t length = out.size
    cdef uintptr_t st = _stream(stream)
    cdef int rc
    with nogil:
        rc = dq_gpu_decompress_out(P, ip, nsg, sg_base, gp, mp, divisor, op, dtype, length, st, NULL)
    _check(rc, "decompress_out")


# One call per tile: a tile of the compressed stream is width-homogeneous
# pieces (width, first stream super-group, count, byte offset in the tile,
# bytes), and a call launches one kernel per piece.  Looping here instead of
# in Python saves each launch its Python round trip, slicing and argument
# checks (tools/host_cost.py --by-kernel; docs/benchmarks.md).

def encode_pieces(params, Source local, pieces, unsigned event, out, inp=None, stream=None):
    """compress (``inp`` None) or dar of every piece of one tile: piece
    (w, s0, cnt, off, nb) encodes stream super-groups s0 .. s0 + cnt with
    ``params[w]`` into out[off:off + nb], reading inp[off:off + nb] for dar."""
    _expect(out, np.uint8, -1, "encode out")
    cdef uint8_t* op = <uint8_t*>_dptr(out, "encode out")
    cdef int64_t osize = out.size
    cdef const uint8_t* ip = NULL
    if inp is not None:
        _expect(inp, np.uint8, -1, "dar input")
        ip = <const uint8_t*>_dptr(inp, "dar input")
        if inp.size < osize:
            osize = inp.size
    cdef uintptr_t st = _stream(stream)
    cdef const DqParams* P = NULL
    cdef int64_t at[4]
    cdef int rc
    cdef DqSource shifted
    for piece in pieces:
        if raw_piece(piece, osize, "encode buffers", at):     # the 16-bit class
            if at[1] == 0:
                continue
            shifted = shifted_source(&local.src, at[0])
            with nogil:
                if ip != NULL:
                    rc = dq_gpu_bf16_dar(<const uint16_t*>(ip + at[2]), &shifted, at[1],
                                         at[1] * DQ_SUPER, <uint16_t*>(op + at[2]), st, NULL)
                else:
                    rc = dq_gpu_bf16_compress(&shifted, at[1], at[1] * DQ_SUPER,
                                              <uint16_t*>(op + at[2]), st, NULL)
            _check(rc, "bf16_dar" if ip != NULL else "bf16_compress")
            continue
        P = piece_params(params, piece, osize, "encode buffers", at)
        check_event(event, P)
        if at[1] == 0:
            continue
        with nogil:
            if ip != NULL:
                rc = dq_gpu_dar(P, ip + at[2], &local.src, at[1], at[0], event, op + at[2], st,
                                NULL)
            else:
                rc = dq_gpu_compress(P, &local.src, at[1], at[0], event, op + at[2], st, NULL)
        _check(rc, "dar" if ip != NULL else "compress")


def decompress_pieces(params, inp, pieces, out, bint accumulate, int64_t sg_first=0, stream=None):
    """decompress every piece of one tile: piece (w, s0, cnt, off, nb) decodes
    inp[off:off + nb] into the float32 rows of stream super-groups s0 .. s0 +
    cnt of ``out``, whose first row is stream super-group ``sg_first``."""
    _expect(inp, np.uint8, -1, "decompress input")
    _expect(out, np.float32, -1, "decompress out")
    cdef const uint8_t* ip = <const uint8_t*>_dptr(inp, "decompress input")
    cdef float* op = <float*>_dptr(out, "decompress out")
    cdef int64_t isize = inp.size, osize = out.size, row
    cdef uintptr_t st = _stream(stream)
    cdef const DqParams* P = NULL
    cdef int64_t at[4]
    cdef int rc
    cdef bint raw
    for piece in pieces:
        raw = raw_piece(piece, isize, "decompress input", at)
        if not raw:
            P = piece_params(params, piece, isize, "decompress input", at)
        row = (at[0] - sg_first) * DQ_SUPER
        piece_in(row, at[1] * DQ_SUPER, osize, "decompress out")
        if at[1] == 0:
            continue
        with nogil:
            if raw:
                rc = dq_gpu_bf16_decompress(<const uint16_t*>(ip + at[2]), at[1] * DQ_SUPER,
                                            op + row, 1 if accumulate else 0, st, NULL)
            else:
                rc = dq_gpu_decompress(P, ip + at[2], at[1], op + row, 1 if accumulate else 0, st,
                                       NULL)
        _check(rc, "bf16_decompress" if raw else "decompress")


def decompress_out_pieces(params, inp, pieces, order, mean_sum, float divisor, out, stream=None):
    """decompress_out of every piece of one tile (see decompress_out); pieces
    of width 16 (raw BF16 records, the 16-bit class) likewise."""
    cdef int dtype = _dtype_code(out, "decompress_out out")
    _expect(inp, np.uint8, -1, "decompress_out input")
    _expect(order, np.int64, -1, "decompress_out order")
    _expect(mean_sum, np.float32, -1, "decompress_out mean_sum")
    if mean_sum.size * SUPER < out.size:
        raise ValueError("decompress_out: mean_sum does not cover the output")
    cdef int64_t length = out.size, isize = inp.size, nrows = order.size
    if length == 0:
        return
    cdef const uint8_t* ip = <const uint8_t*>_dptr(inp, "decompress_out input")
    cdef const int64_t* gp = <const int64_t*>_dptr(order, "decompress_out order")
    cdef const float* mp = <const float*>_dptr(mean_sum, "decompress_out mean_sum")
    cdef void* op = <void*>_dptr(out, "decompress_out out")
    cdef uintptr_t st = _stream(stream)
    cdef const DqParams* P = NULL
    cdef int64_t at[4]
    cdef int rc
    cdef bint raw
    for piece in pieces:
        raw = raw_piece(piece, isize, "decompress_out input", at)     # the 16-bit class
        if not raw:
            P = piece_params(params, piece, isize, "decompress_out input", at)
        if at[0] < 0 or at[0] + at[1] > nrows:
            raise ValueError("decompress_out: stream super-groups beyond the order map")
        if at[1] == 0:
            continue
        with nogil:
            if raw:
                rc = dq_gpu_bf16_decompress_out(<const uint16_t*>(ip + at[2]), at[1], at[0], gp,
                                                mp, divisor, op, dtype, length, st, NULL)
            else:
                rc = dq_gpu_decompress_out(P, ip + at[2], at[1], at[0], gp, mp, divisor, op,
                                           dtype, length, st, NULL)
        _check(rc, "bf16_decompress_out" if raw else "decompress_out")


def finish(stream_values, stream_of_sg, mean_sum, float divisor, out, stream=None, refuse=None,
           float limit=0.0):
    """Scatter the decoded stream back to the caller's layout (see dq_api.h);
    stream_values None: only the rows absent from the stream.  ``refuse``: a
    plan header (float64, device) whose refusal flags make every row NaN
    instead (decided on the device; ``limit``: the largest accepted sum of
    max |x|)."""
    cdef int dtype = _dtype_code(out, "finish out")
    cdef int64_t nsg = stream_of_sg.size
    cdef int64_t length = out.size
    if stream_values is not None:
        _expect(stream_values, np.float32, -1, "finish stream")
    _expect(stream_of_sg, np.int64, -1, "finish stream_of_sg")
    _expect(mean_sum, np.float32, -1, "finish mean_sum")
    if mean_sum.size != nsg or nsg * SUPER < length:
        raise ValueError("finish: super-group arrays do not cover the output")
    if nsg == 0 or length == 0:
        return
    cdef const float* sp = NULL
    if stream_values is not None and stream_values.size:
        sp = <const float*>_dptr(stream_values, "finish stream")
    cdef const int64_t* gp = <const int64_t*>_dptr(stream_of_sg, "finish stream_of_sg")
    cdef const float* mp = <const float*>_dptr(mean_sum, "finish mean_sum")
    cdef void* op = <void*>_dptr(out, "finish out")
    cdef const double* hdr = NULL
    if refuse is not None:
        _expect(refuse, np.float64, PLAN_HEADER, "finish refuse")
        hdr = <const double*>_dptr(refuse, "finish refuse")
    cdef uintptr_t st = _stream(stream)
    cdef int rc
    with nogil:
        rc = dq_gpu_finish(sp, gp, mp, nsg, divisor, op, dtype, length, st, hdr, limit)
    _check(rc, "finish")


# ------------------------------------------------------------------ baselines
# Stream element e < n reads the Source like the DynamiQ kernels (super-group
# map, centring, zero padding beyond the source's length); n = out.size, with
# (nsg - 1) * 256 < n <= nsg * 256 (the last super-group may be partial).

cdef int64_t _plain_count(int64_t nsg, out, what) except -1:
    cdef int64_t n = out.size
    if n > nsg * SUPER or n <= (nsg - 1) * SUPER:
        raise ValueError("%s: %d elements do not end in the last of %d super-groups"
                         % (what, n, nsg))
    return n


# One body per kind of call (compress, decompress, dar), the BF16 or float32
# kernel chosen by the wire element; the public functions check their dtypes.

cdef _plain_compress(Source local, int64_t nsg, out, stream, bint bf16, what):
    if nsg == 0:
        return
    cdef int64_t n = _plain_count(nsg, out, what)
    cdef void* op = <void*>_dptr(out, what + " out")
    cdef uintptr_t st = _stream(stream)
    cdef int rc
    with nogil:
        if bf16:
            rc = dq_gpu_bf16_compress(&local.src, nsg, n, <uint16_t*>op, st, NULL)
        else:
            rc = dq_gpu_exact_compress(&local.src, nsg, n, <float*>op, st, NULL)
    _check(rc, what)


cdef _plain_decompress(inp, out, bint accumulate, stream, bint bf16, what):
    cdef int64_t n = inp.size
    if n == 0:
        return
    cdef const void* ip = <const void*>_dptr(inp, what + " input")
    cdef float* op = <float*>_dptr(out, what + " out")
    cdef uintptr_t st = _stream(stream)
    cdef int rc
    with nogil:
        if bf16:
            rc = dq_gpu_bf16_decompress(<const uint16_t*>ip, n, op, 1 if accumulate else 0, st, NULL)
        else:
            rc = dq_gpu_exact_decompress(<const float*>ip, n, op, 1 if accumulate else 0, st)
    _check(rc, what)


cdef _plain_dar(inp, Source local, int64_t nsg, out, stream, bint bf16, what):
    if nsg == 0:
        return
    cdef int64_t n = _plain_count(nsg, out, what)
    if inp.size != n:
        raise ValueError("%s: input has %d elements, out %d" % (what, inp.size, n))
    cdef const void* ip = <const void*>_dptr(inp, what + " input")
    cdef void* op = <void*>_dptr(out, what + " out")
    cdef uintptr_t st = _stream(stream)
    cdef int rc
    with nogil:
        if bf16:
            rc = dq_gpu_bf16_dar(<const uint16_t*>ip, &local.src, nsg, n, <uint16_t*>op, st, NULL)
        else:
            rc = dq_gpu_exact_dar(<const float*>ip, &local.src, nsg, n, <float*>op, st)
    _check(rc, what)


def bf16_compress(Source local, int64_t nsg, out, stream=None):
    """out[e] = bfloat16(local(e)) (round to nearest even); out is uint16 or bfloat16."""
    if out.dtype.itemsize != 2:
        raise TypeError("bf16_compress out must be uint16 or bfloat16")
    _plain_compress(local, nsg, out, stream, True, "bf16_compress")


def bf16_decompress(inp, out, bint accumulate, stream=None):
    """out (+)= float32(inp), elementwise over inp.size elements."""
    if inp.dtype.itemsize != 2:
        raise TypeError("bf16_decompress input must be uint16 or bfloat16")
    _expect(out, np.float32, inp.size, "bf16_decompress out")
    _plain_decompress(inp, out, accumulate, stream, True, "bf16_decompress")


def bf16_dar(inp, Source local, int64_t nsg, out, stream=None):
    """out[e] = bfloat16(float32(inp[e]) + local(e))."""
    if inp.dtype.itemsize != 2 or out.dtype.itemsize != 2:
        raise TypeError("bf16_dar buffers must be uint16 or bfloat16")
    _plain_dar(inp, local, nsg, out, stream, True, "bf16_dar")


def exact_compress(Source local, int64_t nsg, out, stream=None):
    """out[e] = local(e) (float32)."""
    _expect(out, np.float32, -1, "exact_compress out")
    _plain_compress(local, nsg, out, stream, False, "exact_compress")


def exact_decompress(inp, out, bint accumulate, stream=None):
    """out (+)= inp (float32), elementwise."""
    _expect(inp, np.float32, -1, "exact_decompress input")
    _expect(out, np.float32, inp.size, "exact_decompress out")
    _plain_decompress(inp, out, accumulate, stream, False, "exact_decompress")


def exact_dar(inp, Source local, int64_t nsg, out, stream=None):
    """out[e] = inp[e] + local(e) (float32)."""
    _expect(inp, np.float32, -1, "exact_dar input")
    _expect(out, np.float32, -1, "exact_dar out")
    _plain_dar(inp, local, nsg, out, stream, False, "exact_dar")


# ------------------------------------------------------------------ MX baselines
# Blocks of 32 elements; `fmt` = (bits, mbits, bias, max_normal) of an element
# format; `reduced` the uint8 shared-exponent bytes of the tile's blocks.

cdef DqMxFormat _mx_format(fmt) except *:
    cdef DqMxFormat f
    f.bits, f.mbits, f.bias, f.max_normal = fmt
    return f


cdef int _mx_wire(a, int64_t nblocks, int bits, what) except -1:
    _expect(a, np.uint8, nblocks * 4 * bits, what)
    return 0


def mx_stats(Source x, int64_t nblocks, out, stream=None):
    """out[b] = the shared-exponent byte of block b of x (mx_api.h)."""
    _expect(out, np.uint8, nblocks, "mx_stats out")
    if nblocks == 0:
        return
    cdef uint8_t* op = <uint8_t*>_dptr(out, "mx_stats out")
    cdef uintptr_t st = _stream(stream)
    cdef int rc
    with nogil:
        rc = dq_gpu_mx_stats(&x.src, nblocks, op, st)
    _check(rc, "mx_stats")


def mx_encode(fmt, reduced, int headroom, Source local, int64_t elem_base, inp,
              int64_t nblocks, out, stream=None):
    """out = packed codes of local(elem_base + j) (+ decode(inp)[j]) for the
    nblocks blocks of a tile; inp may be None or out itself."""
    cdef DqMxFormat f = _mx_format(fmt)
    _expect(reduced, np.uint8, nblocks, "mx_encode reduced")
    _mx_wire(out, nblocks, f.bits, "mx_encode out")
    if nblocks == 0:
        return
    cdef const uint8_t* ip = NULL
    if inp is not None:
        _mx_wire(inp, nblocks, f.bits, "mx_encode input")
        ip = <const uint8_t*>_dptr(inp, "mx_encode input")
    cdef const uint8_t* rp = <const uint8_t*>_dptr(reduced, "mx_encode reduced")
    cdef uint8_t* op = <uint8_t*>_dptr(out, "mx_encode out")
    cdef uintptr_t st = _stream(stream)
    cdef int rc
    with nogil:
        rc = dq_gpu_mx_encode(f, rp, headroom, &local.src, elem_base, ip, nblocks, op, st)
    _check(rc, "mx_encode")


def mx_decode(fmt, reduced, int headroom, inp, int64_t nblocks, out, bint accumulate,
              Source local=None, int64_t elem_base=0, stream=None):
    """out[j] = decode(inp)[j] + (local(elem_base + j) if local, else out[j] if
    accumulate, else nothing), float32, 32 * nblocks values."""
    cdef DqMxFormat f = _mx_format(fmt)
    _expect(reduced, np.uint8, nblocks, "mx_decode reduced")
    _mx_wire(inp, nblocks, f.bits, "mx_decode input")
    _expect(out, np.float32, nblocks * 32, "mx_decode out")
    if nblocks == 0:
        return
    cdef const DqSource* lp = NULL
    if local is not None:
        lp = &local.src
    cdef const uint8_t* rp = <const uint8_t*>_dptr(reduced, "mx_decode reduced")
    cdef const uint8_t* ip = <const uint8_t*>_dptr(inp, "mx_decode input")
    cdef float* op = <float*>_dptr(out, "mx_decode out")
    cdef uintptr_t st = _stream(stream)
    cdef int rc
    with nogil:
        rc = dq_gpu_mx_decode(f, rp, headroom, ip, nblocks, lp, elem_base, op,
                              1 if accumulate else 0, st)
    _check(rc, "mx_decode")


# ------------------------------------------------------------------ planner

def plan_scratch_bytes(int64_t nsg):
    """Device scratch bytes plan() needs for nsg super-groups."""
    return dq_gpu_plan_scratch_bytes(nsg)


def plan(int64_t nsg, bint centring, bint zero_class, bint variable, int fixed_width,
         int64_t stats_bits, rec_bits, double budget_bits, double padded_budget_bits,
         norm2, mean_sum, tail, widths, order, stream_of_sg, header, scratch, stream=None,
         bint bf16_class=False):
    """_cpu.plan on CuPy arrays, enqueued on the stream (nothing synchronises);
    ``scratch`` is a uint8 CuPy buffer of plan_scratch_bytes(nsg) bytes."""
    cdef DqPlanArgs a
    fill_plan_args(&a, nsg, centring, zero_class, variable, fixed_width, stats_bits, rec_bits,
                   budget_bits, padded_budget_bits, bf16_class)
    _expect(norm2, np.float32, nsg, "plan norm2")
    _expect(tail, np.float32, 2, "plan tail")
    _expect(widths, np.int8, nsg, "plan widths")
    _expect(order, np.int64, nsg, "plan order")
    _expect(stream_of_sg, np.int64, nsg, "plan stream_of_sg")
    _expect(header, np.float64, PLAN_HEADER, "plan header")
    _expect(scratch, np.uint8, -1, "plan scratch")
    cdef size_t need = dq_gpu_plan_scratch_bytes(nsg)
    if <size_t>scratch.size < need:
        raise ValueError("plan: scratch needs %d bytes, got %d" % (need, scratch.size))
    cdef const float* mp = NULL
    if centring:
        _expect(mean_sum, np.float32, nsg, "plan mean_sum")
        if nsg:
            mp = <const float*>_dptr(mean_sum, "plan mean_sum")
    cdef const float* np_ = <const float*>_dptr(norm2, "plan norm2") if nsg else NULL
    cdef int8_t* wp = <int8_t*>_dptr(widths, "plan widths") if nsg else NULL
    cdef int64_t* op = <int64_t*>_dptr(order, "plan order") if nsg else NULL
    cdef int64_t* sp = <int64_t*>_dptr(stream_of_sg, "plan stream_of_sg") if nsg else NULL
    cdef const float* tp = <const float*>_dptr(tail, "plan tail")
    cdef double* hp = <double*>_dptr(header, "plan header")
    cdef void* scp = <void*>_dptr(scratch, "plan scratch")
    cdef size_t have = scratch.size
    cdef uintptr_t st = _stream(stream)
    cdef int rc
    with nogil:
        rc = dq_gpu_plan(&a, np_, mp, tp, wp, op, sp, hp, scp, have, st)
    _check(rc, "plan")


# ------------------------------------------------------------------ the fixed layout
# A call on device arrays cuts its stream on the device (plan_pieces) into
# tiles of fixed capacity; the kernels read each tile's pieces from the
# device table (dq_plan.h: DQ_TILE_INTS int64 per tile, one entry per stream
# class of 2, 4, 8 and 16 bits, then the tile's range), so no count reaches
# the host.  One launch per class whose capacity ``caps[k]`` (the most
# super-groups of that class one tile can hold) is not 0; ``widths`` names
# the classes (2, 4, 8, 16).

def plan_pieces(header, int64_t n, int64_t tiles_per_chunk, rec_bytes, int64_t cap, table,
                wire=None, stream=None):
    """The piece table of n chunks of ``tiles_per_chunk`` tiles of ``cap``
    bytes each from the plan ``header``'s counts, enqueued (dq_plan_api.h);
    with ``wire`` (n T slots of cap bytes) the padding past each payload is
    zeroed."""
    cdef int64_t rb[4]
    check_layout(n, tiles_per_chunk, rec_bytes, cap, rb)
    _expect(header, np.float64, PLAN_HEADER, "plan_pieces header")
    _expect(table, np.int64, n * tiles_per_chunk * DQ_TILE_INTS, "plan_pieces table")
    cdef double* hp = <double*>_dptr(header, "plan_pieces header")
    cdef int64_t* tp = <int64_t*>_dptr(table, "plan_pieces table")
    cdef uint8_t* wp = NULL
    if wire is not None:
        _expect(wire, np.uint8, n * tiles_per_chunk * cap, "plan_pieces wire")
        if cap:
            wp = <uint8_t*>_dptr(wire, "plan_pieces wire")
    cdef uintptr_t st = _stream(stream)
    cdef int rc
    with nogil:
        rc = dq_gpu_plan_pieces(hp, n, tiles_per_chunk, rb, cap, tp, wp, st)
    _check(rc, "plan_pieces")


cdef const int64_t* _tile_row(table, int64_t tile) except NULL:
    _expect(table, np.int64, -1, "piece table")
    if tile < 0 or (tile + 1) * DQ_TILE_INTS > table.size:
        raise ValueError("piece table: no tile %d in %d entries" % (tile, table.size))
    return <const int64_t*>_dptr(table, "piece table") + tile * DQ_TILE_INTS


cdef int _caps_fit(caps, widths, int64_t nbytes, params, bint hierarchical, what) except -1:
    """Every class's capacity fits a slot of nbytes (the device cut cannot then
    write past it)."""
    if len(caps) != 4 or len(widths) != 4:
        raise ValueError("%s: caps and widths name the four stream classes" % what)
    for k in range(4):
        if caps[k] < 0:
            raise ValueError("%s: negative capacity" % what)
        if caps[k] and widths[k] != 16 and widths[k] not in params:
            raise ValueError("%s: no params for width %s" % (what, widths[k]))
        rec = 2 * DQ_SUPER if widths[k] == 16 else wire_bytes(1, widths[k], 1 if hierarchical else 0)
        if caps[k] * rec > nbytes:
            raise ValueError("%s: %d super-groups of width %d do not fit %d bytes"
                             % (what, caps[k], widths[k], nbytes))
    return 0


def encode_table(params, Source local, table, int64_t tile, caps, widths, bint hierarchical,
                 unsigned event, out, inp=None, stream=None):
    """compress (``inp`` None) or dar of tile ``tile`` of the fixed layout:
    ``out`` (and ``inp``) are the tile's slots."""
    _expect(out, np.uint8, -1, "encode out")
    cdef int64_t osize = out.size
    cdef const uint8_t* ip = NULL
    if inp is not None:
        _expect(inp, np.uint8, -1, "dar input")
        if inp.size < osize:
            osize = inp.size
        ip = <const uint8_t*>_dptr(inp, "dar input")
    _caps_fit(caps, widths, osize, params, hierarchical, "encode_table")
    cdef const int64_t* row = _tile_row(table, tile)
    cdef uint8_t* op = <uint8_t*>_dptr(out, "encode out")
    cdef uintptr_t st = _stream(stream)
    cdef const DqParams* P = NULL
    cdef const uint8_t[::1] blob
    cdef const int64_t* pp
    cdef int64_t cap
    cdef int rc
    cdef int k
    for k in range(4):
        cap = caps[k]
        if cap == 0:
            continue
        pp = row + 4 * k
        if widths[k] == 16:         # the 16-bit class: raw BF16 records
            with nogil:
                if ip != NULL:
                    rc = dq_gpu_bf16_dar(<const uint16_t*>ip, &local.src, cap, cap * DQ_SUPER,
                                         <uint16_t*>op, st, pp)
                else:
                    rc = dq_gpu_bf16_compress(&local.src, cap, cap * DQ_SUPER, <uint16_t*>op,
                                              st, pp)
            _check(rc, "bf16_dar" if ip != NULL else "bf16_compress")
            continue
        blob = params[widths[k]]
        P = _params(blob)
        check_event(event, P)
        with nogil:
            if ip != NULL:
                rc = dq_gpu_dar(P, ip, &local.src, cap, 0, event, op, st, pp)
            else:
                rc = dq_gpu_compress(P, &local.src, cap, 0, event, op, st, pp)
        _check(rc, "dar" if ip != NULL else "compress")


def decompress_table(params, inp, table, int64_t tile, caps, widths, bint hierarchical, out,
                     bint accumulate, stream=None):
    """decompress tile ``tile`` of the fixed layout into the float32 stream
    buffer ``out`` (row s = stream super-group s; every stream super-group
    must have its row)."""
    _expect(inp, np.uint8, -1, "decompress input")
    _expect(out, np.float32, -1, "decompress out")
    _caps_fit(caps, widths, inp.size, params, hierarchical, "decompress_table")
    cdef const int64_t* row = _tile_row(table, tile)
    cdef const uint8_t* ip = <const uint8_t*>_dptr(inp, "decompress input")
    cdef float* op = <float*>_dptr(out, "decompress out")
    cdef uintptr_t st = _stream(stream)
    cdef const DqParams* P = NULL
    cdef const uint8_t[::1] blob
    cdef const int64_t* pp
    cdef int64_t cap
    cdef int rc
    cdef int k
    cdef int acc = 1 if accumulate else 0
    for k in range(4):
        cap = caps[k]
        if cap == 0:
            continue
        pp = row + 4 * k
        if widths[k] == 16:
            with nogil:
                rc = dq_gpu_bf16_decompress(<const uint16_t*>ip, cap * DQ_SUPER, op, acc, st, pp)
            _check(rc, "bf16_decompress")
            continue
        blob = params[widths[k]]
        P = _params(blob)
        with nogil:
            rc = dq_gpu_decompress(P, ip, cap, op, acc, st, pp)
        _check(rc, "decompress")


def decompress_out_table(params, inp, table, int64_t tile, caps, widths, bint hierarchical, order,
                         mean_sum, float divisor, out, stream=None):
    """decompress_out of tile ``tile`` of the fixed layout (see
    decompress_out_pieces); ``order`` covers every stream super-group."""
    cdef int dtype = _dtype_code(out, "decompress_out out")
    _expect(inp, np.uint8, -1, "decompress_out input")
    _expect(order, np.int64, -1, "decompress_out order")
    _expect(mean_sum, np.float32, -1, "decompress_out mean_sum")
    if mean_sum.size * SUPER < out.size:
        raise ValueError("decompress_out: mean_sum does not cover the output")
    _caps_fit(caps, widths, inp.size, params, hierarchical, "decompress_out_table")
    cdef int64_t length = out.size
    if length == 0:
        return
    cdef const int64_t* row = _tile_row(table, tile)
    cdef const uint8_t* ip = <const uint8_t*>_dptr(inp, "decompress_out input")
    cdef const int64_t* gp = <const int64_t*>_dptr(order, "decompress_out order")
    cdef const float* mp = <const float*>_dptr(mean_sum, "decompress_out mean_sum")
    cdef void* op = <void*>_dptr(out, "decompress_out out")
    cdef uintptr_t st = _stream(stream)
    cdef const DqParams* P = NULL
    cdef const uint8_t[::1] blob
    cdef const int64_t* pp
    cdef int64_t cap
    cdef int rc
    cdef int k
    for k in range(4):
        cap = caps[k]
        if cap == 0:
            continue
        pp = row + 4 * k
        if widths[k] == 16:
            with nogil:
                rc = dq_gpu_bf16_decompress_out(<const uint16_t*>ip, cap, 0, gp, mp, divisor, op,
                                                dtype, length, st, pp)
            _check(rc, "bf16_decompress_out")
            continue
        blob = params[widths[k]]
        P = _params(blob)
        with nogil:
            rc = dq_gpu_decompress_out(P, ip, cap, 0, gp, mp, divisor, op, dtype, length, st, pp)
        _check(rc, "decompress_out")


def local_values_table(Source local, table, int64_t tile, int64_t cap, out, stream=None):
    """The float32 source values of tile ``tile``'s super-groups (as the
    encoders read them) into their rows of the stream buffer ``out``."""
    _expect(out, np.float32, -1, "local values out")
    if cap <= 0:
        return
    if cap * SUPER > out.size:
        raise ValueError("local_values_table: %d super-groups exceed the stream buffer" % cap)
    cdef const int64_t* pp = _tile_row(table, tile) + 16
    cdef float* op = <float*>_dptr(out, "local values out")
    cdef uintptr_t st = _stream(stream)
    cdef int rc
    with nogil:
        rc = dq_gpu_exact_compress(&local.src, cap, cap * DQ_SUPER, op, st, pp)
    _check(rc, "exact_compress")


def set_keys(dst, unsigned key_value, unsigned key_perm, stream=None):
    """dst (2 uint32 on the device) = (key_value, key_perm), enqueued: the
    keys a graph replay's encoders read (DqParams.key_ptr)."""
    _expect(dst, np.uint32, 2, "keys")
    cdef uint32_t* dp = <uint32_t*>_dptr(dst, "keys")
    cdef uintptr_t st = _stream(stream)
    cdef int rc
    with nogil:
        rc = dq_gpu_set_keys(dp, key_value, key_perm, st)
    _check(rc, "set_keys")
