"""The inputs of the many-ranks simulator (scale_sim.py): a
:class:`RankSource` produces every rank's vector on demand, row by row, so
that the simulator never holds all ranks' inputs at once.  ``ArraySource``
wraps explicit arrays; ``LogNormalMixture`` is the paper's Table 7 data,
every element a function of its position and rank."""
from __future__ import annotations

import numpy as np

from dynamiq_mpi.rng import splitmix64

SUPER = 256
_M32 = np.uint64(0xFFFFFFFF)


# ----------------------------------------------------------------------------- sources
class RankSource:
    """Every rank's input, produced on demand.  Subclasses give ``length`` and
    :meth:`rows`; ``ranks`` is the number of ranks it can produce (None: any)."""

    length: int = 0
    ranks: int | None = None
    name = "source"

    def rows(self, xp, rank_of_row, row: int):
        """float32 vector of ``length`` elements whose row ``k`` (elements
        ``[k*row, (k+1)*row)``) is that of rank ``rank_of_row[k]`` (a host int
        array of ``ceil(length / row)`` entries; ``row`` divides 256)."""
        raise NotImplementedError

    def rank_vector(self, xp, rank: int):
        """Rank ``rank``'s whole input."""
        nrows = -(-self.length // SUPER)
        return self.rows(xp, np.full(nrows, rank, dtype=np.int64), SUPER)

    def span(self, xp, rank_of_row, row: int, first_row: int):
        """Rows ``first_row .. first_row + len(rank_of_row) - 1`` only (the
        elements ``[first_row*row, min(length, (first_row + k)*row))``), row
        ``first_row + k`` from rank ``rank_of_row[k]``: a slice of the vector
        without producing the rest (scale_levels.py reads shards this way).
        This default produces the whole vector; sources override it."""
        nrows = -(-self.length // row)
        full = np.zeros(nrows, dtype=np.int64)
        k = len(rank_of_row)
        full[first_row:first_row + k] = rank_of_row
        return self.rows(xp, full, row)[first_row * row:min(self.length, (first_row + k) * row)]

    def rows_with_exact(self, xp, rank_of_row, row: int):
        """(:meth:`rows`, None): the float64 values whose sum over the ranks
        is the exact sum, None meaning the rows themselves.  A source whose
        ranks stand for several inputs (a node's sum) returns their float64
        sum here, so the vNMSE is measured against the inputs, not the sums."""
        return self.rows(xp, rank_of_row, row), None


class ArraySource(RankSource):
    """Explicit per-rank arrays, held by the array module they come in
    (NumPy on the host, CuPy on the GPU: no copy across)."""

    name = "arrays"

    def __init__(self, xs):
        xs = list(xs)
        on_device = bool(xs) and type(xs[0]).__module__.startswith("cupy")
        if not on_device:
            xs = [np.asarray(x, dtype=np.float32).reshape(-1) for x in xs]
        if not xs or any(x.shape != xs[0].shape for x in xs):
            raise ValueError("ArraySource needs one or more arrays of one length")
        self._xp = _module_of(xs[0]) if on_device else np
        self.length = int(xs[0].size)
        self.ranks = len(xs)
        padded = -(-self.length // SUPER) * SUPER
        self._data = self._xp.zeros((self.ranks, padded), dtype=np.float32)
        for r, x in enumerate(xs):
            self._data[r, :self.length] = x.reshape(-1)

    def rows(self, xp, rank_of_row, row):
        return self.span(xp, rank_of_row, row, 0)

    def span(self, xp, rank_of_row, row, first_row):
        rank_of_row = np.asarray(rank_of_row, dtype=np.int64)
        if rank_of_row.size and int(rank_of_row.max()) >= self.ranks:
            raise ValueError(f"this source holds {self.ranks} ranks, rank "
                             f"{int(rank_of_row.max())} asked for")
        own = self._xp
        blocks = self._data.reshape(self.ranks, -1, row)
        k = rank_of_row.shape[0]
        out = blocks[own.asarray(rank_of_row), own.arange(first_row, first_row + k)].reshape(-1)
        out = out[:max(0, self.length - first_row * row)]
        if xp is own:
            return out
        return xp.asarray(out.get() if own is not np else out)


def _module_of(x):
    """The array module of a non-NumPy array (CuPy's, for a device array)."""
    import cupy
    if not isinstance(x, cupy.ndarray):
        raise TypeError(f"ArraySource takes NumPy or CuPy arrays, not {type(x).__name__}")
    return cupy


def _fmix32(h):
    """MurmurHash3's 32-bit finaliser, in place (a bijection of uint32)."""
    h ^= h >> np.uint32(16)
    h *= np.uint32(0x85EBCA6B)
    h ^= h >> np.uint32(13)
    h *= np.uint32(0xC2B2AE35)
    h ^= h >> np.uint32(16)
    return h


# The paper's fit of the super-group l2-norm distribution of a LLaMA-1B MMLU
# gradient (paper-notes.md 6.5, Appendix E): K = 2 LogNormal components.
PAPER_MIXTURE = dict(weights=(0.79, 0.21), mu=(-3.99, -16.41), sigma=(1.22, 4.63))


class LogNormalMixture(RankSource):
    """The paper's large-scale synthetic gradient (section 6.2, Table 7):
    super-group ``j`` has magnitude ``M_j`` drawn from a LogNormal mixture
    (``PAPER_MIXTURE`` by default), and rank ``r``'s coordinates are i.i.d.
    ``N(0, M_j^2 / 256)``, independent across ranks.  ``M_j`` is shared by
    every rank (the paper does not say; shared is how real gradients behave:
    the same layers are large everywhere).

    Values come from a counter-based hash of (seed, rank, index): any rank's
    any row is produced in O(1) with no state, on NumPy or CuPy alike (equal
    bits).  Normals by Box-Muller from two 24-bit uniforms (tails to
    5.8 sigma)."""

    name = "lognormal"

    def __init__(self, length: int, seed: int = 0, weights=PAPER_MIXTURE["weights"],
                 mu=PAPER_MIXTURE["mu"], sigma=PAPER_MIXTURE["sigma"]):
        self.length = int(length)
        if self.length >= 1 << 32:
            raise ValueError("at most 2^32 - 1 elements")
        self.seed = int(seed)
        nsg = -(-self.length // SUPER)
        rng = np.random.default_rng([self.seed, 0x6D6978])
        comp = rng.choice(len(weights), size=nsg, p=np.asarray(weights) / np.sum(weights))
        logm = rng.normal(np.asarray(mu)[comp], np.asarray(sigma)[comp])
        self.magnitude = np.exp(logm)                       # M_j, float64
        self._std = (self.magnitude / 16.0).astype(np.float32)
        self._seed_key = np.uint32(splitmix64(self.seed) & 0xFFFFFFFF)
        self._cache = {}

    def _keys(self, ranks):
        r = np.asarray(ranks, dtype=np.uint64)
        h = ((r * np.uint64(0x9E3779B9)) & _M32).astype(np.uint32) ^ self._seed_key
        return _fmix32(h)            # distinct ranks -> distinct keys

    def _index(self, xp, row):
        key = (xp.__name__, row)
        if key not in self._cache:
            nrows = -(-self.length // row)
            # One hash per pair of elements: elements k and k + 16 of every
            # block of 32 (rows are whole blocks, so a pair never straddles
            # two ranks, whatever the row size).
            idx = xp.arange(nrows * row // 2, dtype=np.uint32).reshape(nrows, row // 32, 16)
            idx *= np.uint32(0x9E3779B1)
            std = np.repeat(self._std, SUPER // row)[:nrows]
            self._cache[key] = (idx, xp.asarray(std)[:, None, None])
        return self._cache[key]

    def rows(self, xp, rank_of_row, row):
        return self.span(xp, rank_of_row, row, 0)

    def span(self, xp, rank_of_row, row, first_row):
        idx, std = self._index(xp, row)
        # every element is a function of its position: a slice of rows gives
        # the bits of the same rows of the whole vector
        k = len(rank_of_row)
        idx, std = idx[first_row:first_row + k], std[first_row:first_row + k]
        keys = self._keys(rank_of_row)
        h1 = idx ^ (keys[:, None, None] if xp is np else xp.asarray(keys)[:, None, None])
        _fmix32(h1)
        h2 = h1 ^ np.uint32(0x5BD1E995)
        _fmix32(h2)
        # Box-Muller: the pair's elements are r cos(t) and r sin(t).
        h1 >>= np.uint32(8)
        r = h1.astype(np.float32)
        r += np.float32(1.0)
        r *= np.float32(2.0 ** -24)                         # (0, 1]
        xp.log(r, out=r)
        r *= np.float32(-2.0)
        xp.sqrt(r, out=r)
        r *= std
        h2 >>= np.uint32(8)
        t = h2.astype(np.float32)
        t *= np.float32(2.0 * np.pi * 2.0 ** -24)
        out = xp.empty(idx.shape[:2] + (2, 16), dtype=np.float32)
        c = xp.cos(t)
        c *= r
        out[:, :, 0] = c
        xp.sin(t, out=t)
        t *= r
        out[:, :, 1] = t
        return out.reshape(-1)[:max(0, self.length - first_row * row)]
