# Declarations of the shared codec header's structs (src_cuda/dq_codec.h),
# cimported by both wrappers so the layout and the argument checks are
# written down once.
from libc.stdint cimport int64_t, uint32_t, uint64_t, uint8_t, int32_t

cdef extern from "dq_codec.h":
    enum: DQ_SUPER
    ctypedef struct DqParams:
        int32_t width
        int32_t radius
        int32_t hierarchical
        int32_t correlated
        uint32_t n_events
        uint32_t perm_bits
        uint32_t key_value
        uint32_t key_perm
        int32_t scale_rule
        int32_t pad_
        uint64_t key_ptr
        float mag[128]
        float inv_gap[128]
        float level[256]
        uint8_t lut[4096]
    ctypedef struct DqSource:
        const void* x
        int32_t dtype
        int64_t length
        const int64_t* sg_map
        int64_t sg_offset
        const float* mean
    int dq_record_bytes(int width, int hierarchical)


cdef inline int64_t wire_bytes(int64_t nsg, int width, int hierarchical):
    """Bytes of a run of nsg super-groups (the header's record size)."""
    return nsg * dq_record_bytes(width, hierarchical)


cdef inline int check_event(unsigned event, const DqParams* P) except -1:
    if P.correlated and event >= P.n_events:
        raise ValueError("event %d out of range for %d events" % (event, P.n_events))
    return 0


cdef inline int check_bytes(int64_t nsg, int64_t nbytes, const DqParams* P) except -1:
    need = wire_bytes(nsg, P.width, P.hierarchical)
    if nbytes != need:
        raise ValueError("expected %d wire bytes, got %d" % (need, nbytes))
    return 0


cdef inline int piece_in(int64_t off, int64_t nb, int64_t size, what) except -1:
    if off < 0 or nb < 0 or off + nb > size:
        raise ValueError("%s: piece bytes [%d, %d) outside a buffer of %d" % (what, off, off + nb, size))
    return 0


# Width of the 16-bit class: its pieces are raw BF16 records (256 values, 512
# bytes per super-group) with no DqParams.
cdef enum:
    DQ_RAW_WIDTH = 16
    DQ_RAW_BYTES = 2 * DQ_SUPER


cdef inline bint raw_piece(piece, int64_t size, what, int64_t* at) except -1:
    """True for a piece (w, s0, cnt, off, nb) of the 16-bit class, whose bytes
    are then checked against a buffer of ``size`` bytes (``at`` gets s0, cnt,
    off, nb); False for a coded piece (not checked here: piece_params)."""
    w, s0, cnt, off, nb = piece
    if w != DQ_RAW_WIDTH:
        return False
    piece_in(off, nb, size, what)
    if nb != cnt * DQ_RAW_BYTES:
        raise ValueError("expected %d wire bytes, got %d" % (cnt * DQ_RAW_BYTES, nb))
    at[0] = s0
    at[1] = cnt
    at[2] = off
    at[3] = nb
    return True


cdef inline DqSource shifted_source(const DqSource* S, int64_t s0) nogil:
    """S read from stream super-group s0 on: row(s) of the result is
    row(s0 + s) of S (for the plain kernels, which start at stream super-group 0)."""
    cdef DqSource r = S[0]
    if r.sg_map != NULL:
        r.sg_map = r.sg_map + s0
    else:
        r.sg_offset = r.sg_offset - s0
    return r


cdef inline const DqParams* piece_params(params, piece, int64_t size, what,
                                         int64_t* at) except NULL:
    """The params of one piece (w, s0, cnt, off, nb) of a tile, from
    ``params[w]``; its bytes checked against a buffer of ``size`` bytes and the
    record size; ``at`` gets s0, cnt, off, nb.  (The blob stays alive in
    ``params``.)"""
    w, s0, cnt, off, nb = piece
    cdef const uint8_t[::1] blob = params[w]
    if blob.shape[0] != sizeof(DqParams):
        raise ValueError("params blob has the wrong size")
    cdef const DqParams* P = <const DqParams*>&blob[0]
    piece_in(off, nb, size, what)
    check_bytes(cnt, nb, P)
    at[0] = s0
    at[1] = cnt
    at[2] = off
    at[3] = nb
    return P


cdef extern from "dq_plan_api.h":
    ctypedef struct DqPlanArgs:
        int64_t nsg
        int32_t centring
        int32_t zero_class
        int32_t variable
        int32_t fixed_width
        int64_t stats_bits
        int64_t rec_bits[4]
        double budget_bits
        double padded_budget_bits
        int32_t bf16_class
    int DQ_PLAN_HEADER
    int DQ_TILE_INTS


cdef inline int fill_plan_args(DqPlanArgs* a, int64_t nsg, bint centring, bint zero_class,
                               bint variable, int fixed_width, int64_t stats_bits, rec_bits,
                               double budget_bits, double padded_budget_bits,
                               bint bf16_class) except -1:
    """The planner's arguments, checked once for both wrappers."""
    if fixed_width not in (0, 2, 4, 8):
        raise ValueError("fixed_width must be 0 (widest that fits), 2, 4 or 8")
    if len(rec_bits) != 4:
        raise ValueError("rec_bits needs the record bits of 2-, 4-, 8-bit codes and raw BF16")
    a.nsg = nsg
    a.centring = 1 if centring else 0
    a.zero_class = 1 if zero_class else 0
    a.variable = 1 if variable else 0
    a.fixed_width = fixed_width
    a.stats_bits = stats_bits
    for i in range(4):
        a.rec_bits[i] = rec_bits[i]
    a.bf16_class = 1 if bf16_class else 0
    a.budget_bits = budget_bits
    a.padded_budget_bits = padded_budget_bits
    return 0


cdef inline int check_layout(int64_t n, int64_t tiles_per_chunk, rec_bytes, int64_t cap,
                             int64_t* rb) except -1:
    """The fixed layout's arguments (dq_plan.h), checked once for both wrappers;
    rb gets the record bytes of the runs of 2, 4, 8 and 16 bits."""
    if n < 1 or tiles_per_chunk < 1 or cap < 0:
        raise ValueError("plan_pieces: n and tiles per chunk must be positive, cap >= 0")
    if len(rec_bytes) != 4:
        raise ValueError("plan_pieces: rec_bytes needs the record bytes of 2-, 4-, 8- and 16-bit runs")
    for i in range(4):
        rb[i] = rec_bytes[i]
        if rb[i] < 1:
            raise ValueError("plan_pieces: record bytes must be positive")
    return 0
