# gpu_baselines.pxi -- the BF16 / exact baselines and the MX formats' fused kernels.
# Included by _gpu.pyx (one extension module; the parts share its cimports,
# externs and helpers: _check, _stream, _dptr, _expect, _params, Source).

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
