# Declarations of the shared codec header's structs (src_cuda/dq_codec.h),
# cimported by both wrappers so the layout and the argument checks are
# written down once.
from libc.stdint cimport int64_t, uint32_t, uint8_t, int32_t

cdef extern from "dq_codec.h":
    ctypedef struct DqParams:
        int32_t width
        int32_t radius
        int32_t hierarchical
        int32_t correlated
        uint32_t n_events
        uint32_t perm_bits
        uint32_t key_value
        uint32_t key_perm
        uint32_t key_scale
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
