# gpu_codec.pxi -- DynamiQ on CuPy arrays: statistics, single calls, a tile's pieces, finish.
# Included by _gpu.pyx (one extension module; the parts share its cimports,
# externs and helpers: _check, _stream, _dptr, _expect, _params, Source).

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


def stats_into(x, int64_t nsg, bint centre, mean, norm2, tail, scratch=None, stream=None):
    """stats() written into caller CuPy buffers (see _cpu.stats_into); ``scratch``
    is one int64 device word for the non-finite count, or None (the tail's
    flag says whether there is any)."""
    cdef Source s = Source(x)
    if nsg * SUPER < x.size:
        raise ValueError("stats: %d super-groups do not cover %d values" % (nsg, x.size))
    _expect(norm2, np.float32, nsg, "stats norm2")
    _expect(tail, np.float32, 2, "stats tail")
    cdef int64_t* bp = NULL
    if scratch is not None:
        _expect(scratch, np.int64, 1, "stats scratch")
        bp = <int64_t*>_dptr(scratch, "stats scratch")
    cdef float* mp = NULL
    if mean is not None:
        _expect(mean, np.float32, nsg, "stats mean")
        if nsg:
            mp = <float*>_dptr(mean, "stats mean")
    elif centre:
        raise ValueError("stats_into: centring needs a mean buffer")
    cdef float* np_ = <float*>_dptr(norm2, "stats norm2") if nsg else NULL
    cdef float* tp = <float*>_dptr(tail, "stats tail")
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


# One launch of one piece, coded or raw BF16 (the 16-bit class), shared by the
# tile loops here (host pieces: the count and first super-group known, the
# pointers at the piece, a raw piece's source shifted to it; ``pp`` NULL) and
# the fixed layout's (gpu_layout.pxi: ``pp`` the device piece, ``cnt`` its
# capacity; the kernel reads the rest).

cdef inline int _encode_piece(bint raw, const DqParams* P, const DqSource* src, const uint8_t* ip,
                              uint8_t* op, int64_t cnt, int64_t s0, unsigned event, uintptr_t st,
                              const int64_t* pp) noexcept nogil:
    if raw:
        if ip != NULL:
            return dq_gpu_bf16_dar(<const uint16_t*>ip, src, cnt, cnt * DQ_SUPER, <uint16_t*>op,
                                   st, pp)
        return dq_gpu_bf16_compress(src, cnt, cnt * DQ_SUPER, <uint16_t*>op, st, pp)
    if ip != NULL:
        return dq_gpu_dar(P, ip, src, cnt, s0, event, op, st, pp)
    return dq_gpu_compress(P, src, cnt, s0, event, op, st, pp)


cdef inline int _decode_piece(bint raw, const DqParams* P, const uint8_t* ip, float* op,
                              int64_t cnt, int acc, uintptr_t st, const int64_t* pp) noexcept nogil:
    if raw:
        return dq_gpu_bf16_decompress(<const uint16_t*>ip, cnt * DQ_SUPER, op, acc, st, pp)
    return dq_gpu_decompress(P, ip, cnt, op, acc, st, pp)


cdef inline int _decode_out_piece(bint raw, const DqParams* P, const uint8_t* ip, int64_t cnt,
                                  int64_t s0, const int64_t* gp, const float* mp, float divisor,
                                  void* op, int dtype, int64_t length, uintptr_t st,
                                  const int64_t* pp) noexcept nogil:
    if raw:
        return dq_gpu_bf16_decompress_out(<const uint16_t*>ip, cnt, s0, gp, mp, divisor, op,
                                          dtype, length, st, pp)
    return dq_gpu_decompress_out(P, ip, cnt, s0, gp, mp, divisor, op, dtype, length, st, pp)


cdef str _encode_name(bint raw, bint dar):
    return ("bf16_" if raw else "") + ("dar" if dar else "compress")


# One call per tile: a tile of the compressed stream is width-homogeneous
# pieces (width, first stream super-group, count, byte offset in the tile,
# bytes), and a call launches one kernel per piece.  Looping here instead of
# in Python saves each launch its Python round trip, slicing and argument
# checks (tools/profiling/host_time.py cost --by-kernel; docs/benchmarks.md).

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
    cdef bint raw
    cdef DqSource src
    for piece in pieces:
        raw = raw_piece(piece, osize, "encode buffers", at)     # the 16-bit class
        if not raw:
            P = piece_params(params, piece, osize, "encode buffers", at)
            check_event(event, P)
        if at[1] == 0:
            continue
        src = shifted_source(&local.src, at[0]) if raw else local.src
        with nogil:
            rc = _encode_piece(raw, P, &src, ip + at[2] if ip != NULL else NULL, op + at[2],
                               at[1], at[0], event, st, NULL)
        _check(rc, _encode_name(raw, ip != NULL))


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
            rc = _decode_piece(raw, P, ip + at[2], op + row, at[1], 1 if accumulate else 0, st,
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
            rc = _decode_out_piece(raw, P, ip + at[2], at[1], at[0], gp, mp, divisor, op, dtype,
                                   length, st, NULL)
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
