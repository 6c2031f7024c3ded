# gpu_layout.pxi -- the planner, the fixed layout's piece table and table launchers, graph keys.
# Included by _gpu.pyx (one extension module; the parts share its cimports,
# externs and helpers: _check, _stream, _dptr, _expect, _params, Source).

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


cdef const DqParams* _class_params(params, widths, int k, unsigned event, bint check) except? NULL:
    """The params of stream class k (NULL for the raw BF16 class)."""
    if widths[k] == 16:
        return NULL
    cdef const uint8_t[::1] blob = params[widths[k]]
    cdef const DqParams* P = _params(blob)      # (the blob lives in ``params``)
    if check:
        check_event(event, P)
    return P


cdef int _raw_aligned(caps, widths, uintptr_t a, uintptr_t b, what) except -1:
    """The raw BF16 class reads and writes 2-byte values: its slots must be
    2-byte aligned (the layout's record sizes are even, so its offsets are)."""
    for k in range(4):
        if caps[k] and widths[k] == 16 and ((a | b) & 1):
            raise ValueError("%s: the raw BF16 class needs 2-byte aligned slots" % what)
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
    _raw_aligned(caps, widths, <uintptr_t>ip, <uintptr_t>op, "encode_table")
    cdef uintptr_t st = _stream(stream)
    cdef const DqParams* P
    cdef int64_t cap
    cdef int rc, k
    cdef bint raw
    for k in range(4):
        cap = caps[k]
        if cap == 0:
            continue
        raw = widths[k] == 16
        P = _class_params(params, widths, k, event, True)
        with nogil:
            rc = _encode_piece(raw, P, &local.src, ip, op, cap, 0, event, st, row + 4 * k)
        _check(rc, _encode_name(raw, ip != NULL))


cdef int _covers(int64_t have, int64_t rows, int64_t per_row, what) except -1:
    """A buffer of ``have`` elements covers the stream's ``rows`` rows (the
    device table's pieces lie within them; -1: not checked)."""
    if rows >= 0 and have < rows * per_row:
        raise ValueError("%s: %d elements do not cover %d stream super-groups"
                         % (what, have, rows))
    return 0


def decompress_table(params, inp, table, int64_t tile, caps, widths, bint hierarchical, out,
                     bint accumulate, stream=None, int64_t rows=-1):
    """decompress tile ``tile`` of the fixed layout into the float32 stream
    buffer ``out`` (row s = stream super-group s; every one of the stream's
    ``rows`` super-groups must have its row)."""
    _expect(inp, np.uint8, -1, "decompress input")
    _expect(out, np.float32, -1, "decompress out")
    _covers(out.size, rows, SUPER, "decompress_table out")
    _caps_fit(caps, widths, inp.size, params, hierarchical, "decompress_table")
    cdef const int64_t* row = _tile_row(table, tile)
    cdef const uint8_t* ip = <const uint8_t*>_dptr(inp, "decompress input")
    cdef float* op = <float*>_dptr(out, "decompress out")
    _raw_aligned(caps, widths, <uintptr_t>ip, 0, "decompress_table")
    cdef uintptr_t st = _stream(stream)
    cdef const DqParams* P
    cdef int64_t cap
    cdef int rc, k
    cdef int acc = 1 if accumulate else 0
    cdef bint raw
    for k in range(4):
        cap = caps[k]
        if cap == 0:
            continue
        raw = widths[k] == 16
        P = _class_params(params, widths, k, 0, False)
        with nogil:
            rc = _decode_piece(raw, P, ip, op, cap, acc, st, row + 4 * k)
        _check(rc, "bf16_decompress" if raw else "decompress")


def decompress_out_table(params, inp, table, int64_t tile, caps, widths, bint hierarchical, order,
                         mean_sum, float divisor, out, stream=None, int64_t rows=-1):
    """decompress_out of tile ``tile`` of the fixed layout (see
    decompress_out_pieces); ``order`` covers every one of the stream's
    ``rows`` super-groups."""
    cdef int dtype = _dtype_code(out, "decompress_out out")
    _expect(inp, np.uint8, -1, "decompress_out input")
    _expect(order, np.int64, -1, "decompress_out order")
    _covers(order.size, rows, 1, "decompress_out_table order")
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
    _raw_aligned(caps, widths, <uintptr_t>ip, 0, "decompress_out_table")
    cdef uintptr_t st = _stream(stream)
    cdef const DqParams* P
    cdef int64_t cap
    cdef int rc, k
    cdef bint raw
    for k in range(4):
        cap = caps[k]
        if cap == 0:
            continue
        raw = widths[k] == 16
        P = _class_params(params, widths, k, 0, False)
        with nogil:
            rc = _decode_out_piece(raw, P, ip, cap, 0, gp, mp, divisor, op, dtype, length, st,
                                   row + 4 * k)
        _check(rc, "bf16_decompress_out" if raw else "decompress_out")


def local_values_table(Source local, table, int64_t tile, int64_t cap, out, stream=None,
                       int64_t rows=-1):
    """The float32 source values of tile ``tile``'s super-groups (as the
    encoders read them) into their rows of the stream buffer ``out``, which
    covers the stream's ``rows`` super-groups."""
    _expect(out, np.float32, -1, "local values out")
    _covers(out.size, rows, SUPER, "local_values_table out")
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
