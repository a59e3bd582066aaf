"""Vector-wide loads of rows that are not 16-byte aligned, in Gluon (CUDA, sm_90 PTX).

A row whose start is not 16-byte aligned can only be read one element per instruction if each
thread's elements stay at their logical positions, and narrow accesses cost ~9x the L2 requests of
16-byte ones (``docs/cross_entropy.md``, "Rows that are not 16-byte aligned"). Here a 32 x 128 tile is
held as ``[4, 8, 4, 4, 8]`` (row = 8 g + k, column = 32 blk + 8 q + e; :data:`SPLIT_TILE`): each thread
holds 8 consecutive rows, one per residue k of the row index mod 8, and 8 consecutive columns. With a
16-byte aligned base, row ``r`` of a tile starting on a 32-row and 128-column boundary is misaligned by
``(k * stride) mod A`` elements (A = elements per 16 bytes): a compile-time constant per register row.
So :func:`load_tile` reads the two aligned vectors around each thread's 8 columns and picks the 8 it
needs: a register renaming, no instruction. (The FP8 outputs need no such care: their rows are padded
to 16 bytes, ``meta.mxfp8.mxfp8_data_pitch``.)
"""

from __future__ import annotations

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
except ImportError:  # a Triton without Gluon: no caller uses this module
    gluon = gl = None

if gluon is not None:
    # [4, 8, 4, 4, 8] = (g, k, blk, q, e) on 2 warps: lane = q + 4 blk + 16 (g % 2), warp = g // 2.
    SPLIT_TILE = gl.BlockedLayout([1, 8, 1, 1, 8], [2, 1, 4, 4, 1], [2, 1, 1, 1, 1], [4, 3, 2, 1, 0])

    @gluon.jit
    def split8(x):
        """The 8 slices ``x[:, i]`` of an ``[N, 8]`` tensor whose last dimension is in one thread."""
        N: gl.constexpr = x.shape[0]
        even, odd = gl.split(gl.reshape(x, [N, 4, 2]))
        x04, x26 = gl.split(gl.reshape(even, [N, 2, 2]))
        x15, x37 = gl.split(gl.reshape(odd, [N, 2, 2]))
        x0, x4 = gl.split(x04)
        x2, x6 = gl.split(x26)
        x1, x5 = gl.split(x15)
        x3, x7 = gl.split(x37)
        return x0, x1, x2, x3, x4, x5, x6, x7

    @gluon.jit
    def join8(x0, x1, x2, x3, x4, x5, x6, x7):
        """``[N, 8]`` from 8 ``[N]`` slices: the inverse of :func:`split8`."""
        N: gl.constexpr = x0.shape[0]
        even = gl.reshape(gl.join(gl.join(x0, x4), gl.join(x2, x6)), [N, 4])
        odd = gl.reshape(gl.join(gl.join(x1, x5), gl.join(x3, x7)), [N, 4])
        return gl.reshape(gl.join(even, odd), [N, 8])

    @gluon.jit
    def _pick(a, b, i: gl.constexpr):
        if i < 8:
            return a[i]
        else:
            return b[i - 8]

    @gluon.jit
    def shift8(a, b, S: gl.constexpr):
        """``[N, 8]``: columns ``S..S+7`` of ``a`` followed by ``b`` (``0 <= S < 8``)."""
        pa = split8(a)
        pb = split8(b)
        return join8(
            _pick(pa, pb, S),
            _pick(pa, pb, S + 1),
            _pick(pa, pb, S + 2),
            _pick(pa, pb, S + 3),
            _pick(pa, pb, S + 4),
            _pick(pa, pb, S + 5),
            _pick(pa, pb, S + 6),
            _pick(pa, pb, S + 7),
        )

    @gluon.jit
    def _residue_rows(x):
        """The 8 residue slices of a ``[4, 8, 4, 4, 8]`` tile, each ``[64, 8]`` ((g, blk, q), e)."""
        r = split8(gl.reshape(gl.permute(x, [0, 2, 3, 4, 1]), [512, 8]))
        return (
            gl.reshape(r[0], [64, 8]),
            gl.reshape(r[1], [64, 8]),
            gl.reshape(r[2], [64, 8]),
            gl.reshape(r[3], [64, 8]),
            gl.reshape(r[4], [64, 8]),
            gl.reshape(r[5], [64, 8]),
            gl.reshape(r[6], [64, 8]),
            gl.reshape(r[7], [64, 8]),
        )

    @gluon.jit
    def _from_residue_rows(r0, r1, r2, r3, r4, r5, r6, r7):
        """The inverse of :func:`_residue_rows`."""
        x = join8(
            gl.reshape(r0, [512]),
            gl.reshape(r1, [512]),
            gl.reshape(r2, [512]),
            gl.reshape(r3, [512]),
            gl.reshape(r4, [512]),
            gl.reshape(r5, [512]),
            gl.reshape(r6, [512]),
            gl.reshape(r7, [512]),
        )
        return gl.permute(gl.reshape(x, [4, 4, 4, 8, 8]), [0, 4, 1, 2, 3])

    @gluon.jit
    def tile_index(layout: gl.constexpr):
        """(g, k, blk, q, e) index tensors of the [4, 8, 4, 4, 8] tile, each broadcastable to it."""
        d0: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, gl.SliceLayout(4, layout))))
        d1: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, gl.SliceLayout(4, layout))))
        d2: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, gl.SliceLayout(4, layout))))
        d3: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(4, layout))))
        d4: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, layout))))
        g = gl.arange(0, 4, layout=d0)[:, None, None, None, None]
        k = gl.arange(0, 8, layout=d1)[None, :, None, None, None]
        blk = gl.arange(0, 4, layout=d2)[None, None, :, None, None]
        q = gl.arange(0, 4, layout=d3)[None, None, None, :, None]
        e = gl.arange(0, 8, layout=d4)[None, None, None, None, :]
        return g, k, blk, q, e

    @gluon.jit
    def load_tile(
        ptr, stride_row, tile_row0, tile_col0, rows, n_cols, LOAD_MOD: gl.constexpr, layout: gl.constexpr
    ):
        """The [4, 8, 4, 4, 8] tile of rows ``tile_row0 + 8 g + k`` (``tile_row0`` int64, a multiple of
        32) and columns ``tile_col0 + 32 blk + 8 q + e`` (``tile_col0`` a multiple of 128), 0 outside
        ``rows x n_cols``; ``LOAD_MOD`` = ``stride_row`` mod the elements per 16 bytes, ``ptr`` 16-byte
        aligned. Each 16-byte vector read holds an element of the row or lies in its 16-byte line."""
        ALIGN: gl.constexpr = 128 // ptr.dtype.element_ty.primitive_bitwidth
        g, k, blk, q, e = tile_index(layout)
        row = tile_row0 + g * 8 + k
        start = (row * stride_row) // ALIGN * ALIGN + tile_col0  # row start rounded down to 16 bytes
        skew = (k * LOAD_MOD) % ALIGN
        pos = blk * 32 + q * 8
        row_ok = row < rows
        a = gl.load(ptr + start + pos + e, mask=row_ok & (tile_col0 + pos - skew < n_cols), other=0.0)
        if LOAD_MOD == 0:
            return a
        b = gl.load(ptr + start + pos + 8 + e, mask=row_ok & (tile_col0 + pos + 8 - skew < n_cols), other=0.0)
        ra = _residue_rows(a)
        rb = _residue_rows(b)
        shifted = _from_residue_rows(
            shift8(ra[0], rb[0], (0 * LOAD_MOD) % ALIGN),
            shift8(ra[1], rb[1], (1 * LOAD_MOD) % ALIGN),
            shift8(ra[2], rb[2], (2 * LOAD_MOD) % ALIGN),
            shift8(ra[3], rb[3], (3 * LOAD_MOD) % ALIGN),
            shift8(ra[4], rb[4], (4 * LOAD_MOD) % ALIGN),
            shift8(ra[5], rb[5], (5 * LOAD_MOD) % ALIGN),
            shift8(ra[6], rb[6], (6 * LOAD_MOD) % ALIGN),
            shift8(ra[7], rb[7], (7 * LOAD_MOD) % ALIGN),
        )
        return gl.convert_layout(shifted, layout)
