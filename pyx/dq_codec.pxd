# Declarations of the shared codec header's structs (src_cuda/dq_codec.h),
# cimported by both wrappers so the layout is written down once.
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
