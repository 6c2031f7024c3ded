# cython: language_level=3, boundscheck=False, wraparound=False
"""Thin wrappers of the CPU codec operations (src_cuda/dq_cpu.cpp).

Arrays in, errors out: shapes and dtypes are checked here, the math lives in
the shared header.  The loops run without the GIL.
"""
from libc.stdint cimport int64_t, uint32_t, uint8_t, int32_t
from libc.string cimport memcpy, memset
import numpy as np
cimport numpy as cnp

cnp.import_array()

from libc.stdint cimport int8_t
from dq_codec cimport (DQ_PLAN_HEADER, DQ_SUPER, DQ_TILE_INTS, DqParams, DqPlanArgs, DqSource,
                      check_bytes, check_event, check_layout, fill_plan_args, piece_in,
                      piece_params, raw_piece, wire_bytes)

cdef extern from "dq_api.h":
    int64_t dq_cpu_stats(const DqSource* S, int64_t nsg, int centre, float* mean, float* norm2,
                         float* tail) nogil
    void dq_cpu_compress(const DqParams* P, const DqSource* local, int64_t nsg, int64_t sg_base,
                         uint32_t event, uint8_t* out) nogil
    void dq_cpu_decompress(const DqParams* P, const uint8_t* inp, int64_t nsg,
                           float* out, int accumulate) nogil
    void dq_cpu_dar(const DqParams* P, const uint8_t* inp, const DqSource* local, int64_t nsg,
                    int64_t sg_base, uint32_t event, uint8_t* out) nogil
    void dq_cpu_finish(const float* stream, const int64_t* stream_of_sg, const float* mean_sum,
                       int64_t nsg, float divisor, void* out, int dtype, int64_t length) nogil
    void dq_cpu_decompress_out(const DqParams* P, const uint8_t* inp, int64_t nsg, int64_t sg_base,
                               const int64_t* order, const float* mean_sum, float divisor,
                               void* out, int dtype, int64_t length) nogil
    void dq_cpu_bf16_encode(const uint8_t* inp, const DqSource* local, int64_t nsg,
                            int64_t sg_base, uint8_t* out) nogil
    void dq_cpu_bf16_decompress(const uint8_t* inp, int64_t n, float* out, int accumulate) nogil
    void dq_cpu_bf16_decompress_out(const uint8_t* inp, int64_t nsg, int64_t sg_base,
                                    const int64_t* order, const float* mean_sum, float divisor,
                                    void* out, int dtype, int64_t length) nogil

cdef extern from "dq_plan_api.h":
    void dq_cpu_plan(const DqPlanArgs* A, const float* norm2, const float* mean_sum,
                     const float* tail, int8_t* widths, int64_t* order, int64_t* stream_of_sg,
                     double* header) nogil
    void dq_cpu_plan_pieces(double* header, int64_t n, int64_t T, const int64_t* rb, int64_t cap,
                            int64_t* table, uint8_t* wire) nogil

SUPER = 256
PARAMS_SIZE = sizeof(DqParams)
cdef DqParams _layout_probe
# byte offsets in a DqParams blob of the per-call fields: key_value (key_perm
# follows) and key_ptr (the device address of both, for graph replays)
PARAMS_KEYS_AT = <char*>&_layout_probe.key_value - <char*>&_layout_probe
PARAMS_KEY_PTR_AT = <char*>&_layout_probe.key_ptr - <char*>&_layout_probe
PLAN_HEADER = DQ_PLAN_HEADER
TILE_INTS = DQ_TILE_INTS


def make_params(int width, bint hierarchical, bint correlated, unsigned n_events,
                unsigned perm_bits, unsigned key_value, unsigned key_perm,
                mag, inv_gap, level, lut, int scale_rule=0):
    """Pack a DqParams struct into bytes (the same bytes the GPU receives);
    scale_rule: 0 rounded-up group codes (spec 2.7), 1 hybrid."""
    cdef DqParams p
    memset(&p, 0, sizeof(DqParams))
    cdef int radius = (1 << (width - 1)) - 1
    mag = np.ascontiguousarray(mag, dtype=np.float32)
    inv_gap = np.ascontiguousarray(inv_gap, dtype=np.float32)
    level = np.ascontiguousarray(level, dtype=np.float32)
    lut = np.ascontiguousarray(lut, dtype=np.uint8)
    if mag.shape[0] != radius + 1 or inv_gap.shape[0] != radius or level.shape[0] != 2 * radius + 1:
        raise ValueError("level tables do not match width %d" % width)
    if lut.shape[0] != 4096:
        raise ValueError("lookup table must have 4096 cells")
    if n_events < 1 or n_events > (1 << 30):
        raise ValueError("n_events must be in [1, 2^30], got %d" % n_events)
    if correlated and n_events > (1 << 24):
        # the header compares n p - pi in float32: exact (and the GPU's integer
        # comparison the same bits) only while pi < 2^24
        raise ValueError("correlated rounding takes at most 2^24 events (ranks), got %d" % n_events)
    if perm_bits != (n_events - 1).bit_length():
        raise ValueError("perm_bits must be %d for n_events=%d, got %d"
                         % ((n_events - 1).bit_length(), n_events, perm_bits))
    p.width = width
    p.radius = radius
    p.hierarchical = 1 if hierarchical else 0
    p.correlated = 1 if correlated else 0
    p.n_events = n_events
    p.perm_bits = perm_bits
    p.key_value = key_value
    p.key_perm = key_perm
    if scale_rule not in (0, 1):
        raise ValueError("scale_rule must be 0 (rounded up) or 1 (hybrid), got %d" % scale_rule)
    p.scale_rule = scale_rule
    cdef float[::1] m = mag
    cdef float[::1] g = inv_gap
    cdef float[::1] l = level
    cdef uint8_t[::1] t = lut
    memcpy(p.mag, &m[0], (radius + 1) * sizeof(float))
    memcpy(p.inv_gap, &g[0], radius * sizeof(float))
    memcpy(p.level, &l[0], (2 * radius + 1) * sizeof(float))
    memcpy(p.lut, &t[0], 4096)
    return (<char*>&p)[:sizeof(DqParams)]


cdef const DqParams* _params(const uint8_t[::1] blob) except NULL:
    if blob.shape[0] != sizeof(DqParams):
        raise ValueError("params blob has the wrong size")
    return <const DqParams*>&blob[0]


cdef int _dtype_code(cnp.ndarray x) except -1:
    if not x.flags.c_contiguous or x.ndim != 1:
        raise ValueError("codec arrays must be flat and C-contiguous")
    if x.dtype == np.float32:
        return 0
    if x.dtype.itemsize == 2 and x.dtype.name == "bfloat16":
        return 1
    raise TypeError("unsupported dtype %s (float32 or bfloat16)" % x.dtype)


cdef class Source:
    """Where local values come from: a flat float32/bfloat16 array read by
    super-group through an optional map, minus optional per-row means."""
    cdef DqSource src
    cdef object _keep

    def __cinit__(self, cnp.ndarray x, sg_map=None, int64_t sg_offset=0, mean=None):
        self.src.dtype = _dtype_code(x)
        self.src.x = cnp.PyArray_DATA(x)
        self.src.length = x.shape[0]
        self.src.sg_offset = sg_offset
        self.src.sg_map = NULL
        self.src.mean = NULL
        keep = [x]
        cdef cnp.ndarray m
        if sg_map is not None:
            m = np.ascontiguousarray(sg_map, dtype=np.int64)
            self.src.sg_map = <const int64_t*>cnp.PyArray_DATA(m)
            keep.append(m)
        if mean is not None:
            m = np.ascontiguousarray(mean, dtype=np.float32)
            self.src.mean = <const float*>cnp.PyArray_DATA(m)
            keep.append(m)
        self._keep = keep


def run_bytes(int64_t nsg, int width, bint hierarchical):
    return wire_bytes(nsg, width, 1 if hierarchical else 0)


def stats(cnp.ndarray x, int64_t nsg, bint centre):
    """Per super-group (mean, squared norm of centred values) of the first nsg
    super-groups of x (zero-padded), and the count of non-finite inputs."""
    cdef Source s = Source(x)
    if nsg * SUPER < x.shape[0]:
        raise ValueError("stats: %d super-groups do not cover %d values" % (nsg, x.shape[0]))
    mean = np.empty(nsg, np.float32)
    norm2 = np.empty(nsg, np.float32)
    cdef float[::1] mv = mean
    cdef float[::1] nv = norm2
    cdef int64_t bad = 0
    if nsg:
        with nogil:
            bad = dq_cpu_stats(&s.src, nsg, 1 if centre else 0, &mv[0], &nv[0], NULL)
    return mean, norm2, bad


def stats_into(cnp.ndarray x, int64_t nsg, bint centre, mean, float[::1] norm2, float[::1] tail):
    """stats() written into caller buffers: ``mean`` (float32[nsg], or None when
    not centring), ``norm2`` (float32[nsg]) and ``tail`` (float32[2]: 1 if any
    input is non-finite else 0, and max |x|)."""
    cdef Source s = Source(x)
    if nsg * SUPER < x.shape[0]:
        raise ValueError("stats: %d super-groups do not cover %d values" % (nsg, x.shape[0]))
    if norm2.shape[0] != nsg or tail.shape[0] != 2:
        raise ValueError("stats_into: norm2 needs %d values and tail 2" % nsg)
    cdef float[::1] mv
    cdef float* mp = NULL
    if mean is not None:
        mv = mean
        if mv.shape[0] != nsg:
            raise ValueError("stats_into: mean needs %d values" % nsg)
        if nsg:
            mp = &mv[0]
    elif centre:
        raise ValueError("stats_into: centring needs a mean buffer")
    cdef float* np_ = &norm2[0] if nsg else NULL
    with nogil:
        dq_cpu_stats(&s.src, nsg, 1 if centre else 0, mp, np_, &tail[0])


def compress(const uint8_t[::1] params, Source local, int64_t nsg, int64_t sg_base,
             unsigned event, uint8_t[::1] out):
    cdef const DqParams* P = _params(params)
    check_bytes(nsg, out.shape[0], P)
    check_event(event, P)
    if nsg:
        with nogil:
            dq_cpu_compress(P, &local.src, nsg, sg_base, event, &out[0])


def decompress(const uint8_t[::1] params, const uint8_t[::1] inp, int64_t nsg,
               float[::1] out, bint accumulate):
    cdef const DqParams* P = _params(params)
    check_bytes(nsg, inp.shape[0], P)
    if out.shape[0] != nsg * SUPER:
        raise ValueError("expected %d output values, got %d" % (nsg * SUPER, out.shape[0]))
    if nsg:
        with nogil:
            dq_cpu_decompress(P, &inp[0], nsg, &out[0], 1 if accumulate else 0)


def dar(const uint8_t[::1] params, const uint8_t[::1] inp, Source local,
        int64_t nsg, int64_t sg_base, unsigned event, uint8_t[::1] out):
    cdef const DqParams* P = _params(params)
    check_bytes(nsg, inp.shape[0], P)
    check_bytes(nsg, out.shape[0], P)
    check_event(event, P)
    if nsg:
        with nogil:
            dq_cpu_dar(P, &inp[0], &local.src, nsg, sg_base, event, &out[0])


# One call per tile, as _gpu: pieces (width, first stream super-group,
# count, byte offset in the tile, bytes), one kernel call each.  Width 16 is
# the 16-bit class: raw BF16 records, no params.

def encode_pieces(params, Source local, pieces, unsigned event, uint8_t[::1] out, inp=None):
    """compress (``inp`` None) or dar of every piece of one tile (see _gpu)."""
    cdef const uint8_t[::1] iv
    cdef bint dar_ = inp is not None
    cdef int64_t size = out.shape[0]
    if dar_:
        iv = inp
        if iv.shape[0] < size:
            size = iv.shape[0]
    cdef const DqParams* P = NULL
    cdef int64_t at[4]
    for piece in pieces:
        if raw_piece(piece, size, "encode buffers", at):
            if at[1] == 0:
                continue
            with nogil:
                if dar_:
                    dq_cpu_bf16_encode(&iv[at[2]], &local.src, at[1], at[0], &out[at[2]])
                else:
                    dq_cpu_bf16_encode(NULL, &local.src, at[1], at[0], &out[at[2]])
            continue
        P = piece_params(params, piece, size, "encode buffers", at)
        check_event(event, P)
        if at[1] == 0:
            continue
        with nogil:
            if dar_:
                dq_cpu_dar(P, &iv[at[2]], &local.src, at[1], at[0], event, &out[at[2]])
            else:
                dq_cpu_compress(P, &local.src, at[1], at[0], event, &out[at[2]])


def decompress_pieces(params, const uint8_t[::1] inp, pieces, float[::1] out, bint accumulate,
                      int64_t sg_first=0):
    """decompress every piece of one tile into the float32 rows of ``out``,
    whose first row is stream super-group ``sg_first`` (see _gpu)."""
    cdef const DqParams* P = NULL
    cdef int64_t at[4]
    cdef int64_t row
    cdef bint raw
    for piece in pieces:
        raw = raw_piece(piece, inp.shape[0], "decompress input", at)
        if not raw:
            P = piece_params(params, piece, inp.shape[0], "decompress input", at)
        row = (at[0] - sg_first) * DQ_SUPER
        piece_in(row, at[1] * DQ_SUPER, out.shape[0], "decompress out")
        if at[1] == 0:
            continue
        with nogil:
            if raw:
                dq_cpu_bf16_decompress(&inp[at[2]], at[1] * DQ_SUPER, &out[row],
                                       1 if accumulate else 0)
            else:
                dq_cpu_decompress(P, &inp[at[2]], at[1], &out[row], 1 if accumulate else 0)


def decompress_out_pieces(params, const uint8_t[::1] inp, pieces, const int64_t[::1] order,
                          const float[::1] mean_sum, float divisor, cnp.ndarray out):
    """Decode every piece of one tile straight into the caller's layout: stream
    super-group s goes to input row order[s] of ``out`` (float32 or BF16,
    flat), as decompress then finish would write it (same bits)."""
    cdef int dtype = _dtype_code(out)
    cdef int64_t length = out.shape[0], nrows = order.shape[0]
    if mean_sum.shape[0] * SUPER < length:
        raise ValueError("decompress_out: mean_sum does not cover the output")
    if length == 0:
        return
    cdef void* o = cnp.PyArray_DATA(out)
    cdef const DqParams* P = NULL
    cdef int64_t at[4]
    cdef bint raw
    for piece in pieces:
        raw = raw_piece(piece, inp.shape[0], "decompress_out input", at)
        if not raw:
            P = piece_params(params, piece, inp.shape[0], "decompress_out input", at)
        if at[0] < 0 or at[0] + at[1] > nrows:
            raise ValueError("decompress_out: stream super-groups beyond the order map")
        if at[1] == 0:
            continue
        with nogil:
            if raw:
                dq_cpu_bf16_decompress_out(&inp[at[2]], at[1], at[0], &order[0], &mean_sum[0],
                                           divisor, o, dtype, length)
            else:
                dq_cpu_decompress_out(P, &inp[at[2]], at[1], at[0], &order[0], &mean_sum[0],
                                      divisor, o, dtype, length)


def finish(stream, const int64_t[::1] stream_of_sg, const float[::1] mean_sum,
           float divisor, cnp.ndarray out, refuse=None, float limit=0.0):
    """Scatter the decoded stream back to the caller's layout (see dq_api.h);
    stream None: only the rows absent from the stream (the others were
    written by decompress_out_pieces).  ``refuse``: a plan header whose
    refusal flags make every value NaN instead (see _gpu.finish)."""
    if refuse is not None and refused(refuse, limit):
        out.fill(np.nan)
        return
    cdef int dtype = _dtype_code(out)
    cdef int64_t nsg = stream_of_sg.shape[0]
    cdef int64_t length = out.shape[0]
    cdef const float[::1] sv
    cdef const float* sp = NULL
    cdef int64_t g
    if mean_sum.shape[0] != nsg or nsg * SUPER < length:
        raise ValueError("finish: super-group arrays do not cover the output")
    if stream is not None:
        sv = stream
        for g in range(nsg):          # every stream row the scatter reads is there
            if stream_of_sg[g] >= 0 and (stream_of_sg[g] + 1) * SUPER > sv.shape[0]:
                raise ValueError("finish: the stream does not cover stream_of_sg")
        if sv.shape[0]:
            sp = &sv[0]
    cdef void* o = cnp.PyArray_DATA(out)
    if nsg:
        with nogil:
            dq_cpu_finish(sp, &stream_of_sg[0], &mean_sum[0], nsg, divisor, o, dtype, length)


def plan(int64_t nsg, bint centring, bint zero_class, bint variable, int fixed_width,
         int64_t stats_bits, rec_bits, double budget_bits, double padded_budget_bits,
         const float[::1] norm2, mean_sum, const float[::1] tail, int8_t[::1] widths,
         int64_t[::1] order, int64_t[::1] stream_of_sg, double[::1] header,
         bint bf16_class=False):
    """The call's plan from the reduced statistics (see src_cuda/dq_plan_api.h)."""
    cdef DqPlanArgs a
    fill_plan_args(&a, nsg, centring, zero_class, variable, fixed_width, stats_bits, rec_bits,
                   budget_bits, padded_budget_bits, bf16_class)
    if norm2.shape[0] != nsg or widths.shape[0] != nsg or order.shape[0] != nsg \
            or stream_of_sg.shape[0] != nsg:
        raise ValueError("plan: per-super-group arrays need %d entries" % nsg)
    if tail.shape[0] != 2 or header.shape[0] != PLAN_HEADER:
        raise ValueError("plan: tail needs 2 values and header %d" % PLAN_HEADER)
    cdef const float[::1] mv
    cdef const float* mp = NULL
    if centring:
        mv = mean_sum
        if mv.shape[0] != nsg:
            raise ValueError("plan: mean_sum needs %d entries" % nsg)
        if nsg:
            mp = &mv[0]
    cdef const float* np_ = &norm2[0] if nsg else NULL
    cdef int8_t* wp = &widths[0] if nsg else NULL
    cdef int64_t* op = &order[0] if nsg else NULL
    cdef int64_t* sp = &stream_of_sg[0] if nsg else NULL
    with nogil:
        dq_cpu_plan(&a, np_, mp, &tail[0], wp, op, sp, &header[0])


# ------------------------------------------------------------------ the fixed layout
# The CPU twins of _gpu's table functions: the same piece table (dq_plan.h),
# whose rows become the pieces of the *_pieces functions.

def refused(const double[::1] header, float limit):
    """The plan header's refusal (k_finish's test): non-finite input, a sum of
    max |x| above ``limit``, means that overflowed, a layout overflow, or
    another block's refusal (a reduce-scatter)."""
    return (not header[0] <= 0.0 or not header[1] <= <double>limit or header[2] == 0.0
            or header[11] != 0.0 or header[12] != 0.0)


def plan_pieces(double[::1] header, int64_t n, int64_t tiles_per_chunk, rec_bytes, int64_t cap,
                int64_t[::1] table, wire=None):
    """The piece table of n chunks of ``tiles_per_chunk`` tiles of ``cap``
    bytes (see _gpu.plan_pieces)."""
    cdef int64_t rb[4]
    check_layout(n, tiles_per_chunk, rec_bytes, cap, rb)
    if header.shape[0] != PLAN_HEADER:
        raise ValueError("plan_pieces: header needs %d values" % PLAN_HEADER)
    if table.shape[0] != n * tiles_per_chunk * DQ_TILE_INTS:
        raise ValueError("plan_pieces: table needs %d entries" % (n * tiles_per_chunk * DQ_TILE_INTS))
    cdef uint8_t[::1] wv
    cdef uint8_t* wp = NULL
    if wire is not None:
        wv = wire
        if wv.shape[0] != n * tiles_per_chunk * cap:
            raise ValueError("plan_pieces: wire needs %d bytes" % (n * tiles_per_chunk * cap))
        if cap:
            wp = &wv[0]
    with nogil:
        dq_cpu_plan_pieces(&header[0], n, tiles_per_chunk, rb, cap, &table[0], wp)


def table_pieces(table, int64_t tile, widths):
    """The pieces (w, s0, cnt, off, nb) of tile ``tile`` of a piece table."""
    row = table[tile * DQ_TILE_INTS:(tile + 1) * DQ_TILE_INTS]
    return [(widths[k], int(row[4 * k]), int(row[4 * k + 1]), int(row[4 * k + 2]),
             int(row[4 * k + 3])) for k in range(4) if row[4 * k + 1] > 0]


def encode_table(params, Source local, table, int64_t tile, caps, widths, bint hierarchical,
                 unsigned event, out, inp=None):
    encode_pieces(params, local, table_pieces(table, tile, widths), event, out, inp)


def decompress_table(params, inp, table, int64_t tile, caps, widths, bint hierarchical, out,
                     bint accumulate, rows=-1):
    decompress_pieces(params, inp, table_pieces(table, tile, widths), out, accumulate, 0)


def decompress_out_table(params, inp, table, int64_t tile, caps, widths, bint hierarchical, order,
                         mean_sum, float divisor, out, rows=-1):
    decompress_out_pieces(params, inp, table_pieces(table, tile, widths), order, mean_sum,
                          divisor, out)
