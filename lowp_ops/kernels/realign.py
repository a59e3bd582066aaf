"""Vector-wide loads and stores of rows that are not 16-byte aligned, in Gluon (CUDA, sm_90 PTX).

A row whose start is not 16-byte aligned can only be read or written one element per instruction if
each thread's elements stay at their logical positions, and narrow accesses cost ~9x the L2 requests
of 16-byte ones (``docs/cross_entropy.md``, "Rows that are not 16-byte aligned"). Here a 32 x 128
tile is held as ``[4, 8, 4, 4, 8]`` (row = 8 g + k, column = 32 blk + 8 q + e; :data:`SPLIT_TILE`):
each thread holds 8 consecutive rows, one per residue k of the row index mod 8, and 8 consecutive
columns. With 16-byte aligned bases, row ``r`` of a tile starting on a 32-row and 128-column boundary
is misaligned by ``(k * stride) mod A`` elements (A = elements per 16 bytes): a compile-time constant
per register row. So:

- loads read the two aligned vectors around each thread's 8 columns and pick the 8 it needs: a
  register renaming, no instruction (:func:`load_tile`);
- stores pack each thread's 8 FP8 bytes into one 64-bit word, take the previous lane's word (one
  ``shfl``; lane ``q`` holds columns ``8q..8q+7`` of the 16-lane row segment) and funnel-shift the two
  into the aligned word that holds the thread's last bytes; the two words that a tile shares with its
  neighbours are written byte by byte (:func:`store_tile`).
"""

from __future__ import annotations

from .mxfp8 import cast_satfinite

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

    @gluon.jit
    def previous_lane_u64(word, src_lane):
        """``word`` of lane ``src_lane`` of this thread's 16-lane half-warp (two ``shfl.sync.idx``)."""
        return gl.inline_asm_elementwise(
            "{ .reg .b32 lo, hi; mov.b64 {lo, hi}, $1; "
            "shfl.sync.idx.b32 lo, lo, $2, 0x101f, 0xffffffff; "
            "shfl.sync.idx.b32 hi, hi, $2, 0x101f, 0xffffffff; mov.b64 $0, {lo, hi}; }",
            "=l,l,r",
            [word, src_lane],
            dtype=gl.uint64,
            is_pure=True,
            pack=1,
        )

    @gluon.jit
    def _funnel(word, prev, T: gl.constexpr):
        """(aligned word: ``prev``'s last ``T`` bytes then ``word``'s first ``8 - T``, ``word``'s last
        ``T`` bytes at the start of a word)."""
        if T == 0:
            return word, word
        else:
            return (word << (8 * T)) | (prev >> (64 - 8 * T)), word >> (64 - 8 * T)

    @gluon.jit
    def _words_by_residue(w):
        """The 8 residue slices ``[64]`` of ``[4, 8, 4, 4]`` words."""
        return split8(gl.reshape(gl.permute(w, [0, 2, 3, 1]), [64, 8]))

    @gluon.jit
    def _words_from_residues(w0, w1, w2, w3, w4, w5, w6, w7):
        """The inverse of :func:`_words_by_residue`."""
        return gl.permute(gl.reshape(join8(w0, w1, w2, w3, w4, w5, w6, w7), [4, 4, 4, 8]), [0, 3, 1, 2])

    @gluon.jit
    def word_index(layout: gl.constexpr):
        """(g, k, blk, q) index tensors of [4, 8, 4, 4] words, each broadcastable to them."""
        d0: gl.constexpr = gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, layout)))
        d1: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, layout)))
        d2: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, layout)))
        d3: gl.constexpr = gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, layout)))
        g = gl.arange(0, 4, layout=d0)[:, None, None, None]
        k = gl.arange(0, 8, layout=d1)[None, :, None, None]
        blk = gl.arange(0, 4, layout=d2)[None, None, :, None]
        q = gl.arange(0, 4, layout=d3)[None, None, None, :]
        return g, k, blk, q

    @gluon.jit
    def fp8_words(scaled, OUT_DTYPE: gl.constexpr):
        """``[4, 8, 4, 4]`` uint64: the 8 FP8 bytes (``cvt.rn.satfinite``, as ``mxfp8.cast_satfinite``)
        of each thread's 8 columns of the fp32 tile ``scaled`` [4, 8, 4, 4, 8]. Packed by the
        conversion itself: Triton's fp8 tensors are ``<2 x i8>`` values that LLVM's NVPTX backend
        mis-extracts when shifted into wider integers (one byte in four came out wrong)."""
        if gl.float8e4nv == OUT_DTYPE:
            asm: gl.constexpr = (
                "{ .reg .b16 lo, hi; cvt.rn.satfinite.e4m3x2.f32 lo, $5, $4; "
                "cvt.rn.satfinite.e4m3x2.f32 hi, $7, $6; mov.b32 $0, {lo, hi}; "
                "mov.b32 $1, $0; mov.b32 $2, $0; mov.b32 $3, $0; }"
            )
        else:
            asm: gl.constexpr = (
                "{ .reg .b16 lo, hi; cvt.rn.satfinite.e5m2x2.f32 lo, $5, $4; "
                "cvt.rn.satfinite.e5m2x2.f32 hi, $7, $6; mov.b32 $0, {lo, hi}; "
                "mov.b32 $1, $0; mov.b32 $2, $0; mov.b32 $3, $0; }"
            )
        # Each element: the 4 bytes of its group of 4 columns.
        quads = gl.inline_asm_elementwise(
            asm, "=r,=r,=r,=r,r,r,r,r", [scaled], dtype=gl.uint32, is_pure=True, pack=4
        )
        parts = split8(gl.reshape(quads, [512, 8]))
        low = gl.reshape(parts[0], [4, 8, 4, 4]).to(gl.uint64)
        high = gl.reshape(parts[4], [4, 8, 4, 4]).to(gl.uint64)
        return (high << 32) | low

    @gluon.jit
    def store_tile(
        ptr, scaled, tile_row0, tile_col0, rows, n_cols, FP8_MAX: gl.constexpr, OUT_DTYPE: gl.constexpr,
        STORE_MOD: gl.constexpr, layout: gl.constexpr,
    ):  # fmt: skip
        """Store the fp32 tile ``scaled`` [32, 4, 32] (rows, 32-column blocks, columns), cast to FP8 as
        ``mxfp8.cast_satfinite`` casts it, at rows ``tile_row0 + r``, columns ``tile_col0 + c`` of the
        contiguous ``(rows, n_cols)`` array at ``ptr`` (8-byte aligned); ``STORE_MOD`` = ``n_cols`` mod
        8. In-bounds elements only."""
        x = gl.convert_layout(gl.reshape(scaled, [4, 8, 4, 4, 8]), layout)
        g, k, blk, q, e = tile_index(layout)
        row = tile_row0 + g * 8 + k
        if tile_col0 + 128 > n_cols:
            # The row's last tile: byte stores (one tile in n_cols / 128).
            cols = tile_col0 + blk * 32 + q * 8 + e
            data = cast_satfinite(x, FP8_MAX, OUT_DTYPE)
            gl.store(ptr + row * n_cols + cols, data, mask=(row < rows) & (cols < n_cols))
        else:
            words: gl.constexpr = gl.SliceLayout(4, layout)
            word = gl.convert_layout(fp8_words(x, OUT_DTYPE), words)
            g4, k4, blk4, q4 = word_index(words)
            row4 = tile_row0 + g4 * 8 + k4
            lane = blk4 * 4 + q4  # this thread's 8 columns: 8 lane .. 8 lane + 7 of the tile
            skew = (k4 * STORE_MOD) % 8
            base = (row4 * n_cols) // 8 * 8 + tile_col0  # the row's tile start rounded down to 8 bytes
            word_ptr = (ptr + base + lane * 8).to(gl.pointer_type(gl.uint64), bitcast=True)
            if STORE_MOD == 0:
                gl.store(word_ptr, word, mask=row4 < rows)
            else:
                src = (lane + 15) % 16 + gl.zeros([4, 8, 4, 4], gl.int32, layout=words)
                aligned, tails = _funnel_words(word, previous_lane_u64(word, src), STORE_MOD)
                # Lane 0's word also holds the previous tile's last bytes: it stores its own bytes
                # alone, as lane 15 does for the word after the tile.
                gl.store(word_ptr, aligned, mask=(row4 < rows) & ((lane > 0) | (skew == 0)))
                edge = gl.where(lane == 0, aligned, tails)[:, :, :, :, None]
                edge_bytes = ((edge >> (e * 8).to(gl.uint64)) & 0xFF).to(gl.uint8)
                lane5 = lane[:, :, :, :, None]
                skew5 = skew[:, :, :, :, None]
                offset = base[:, :, :, :, None] + gl.where(lane5 == 0, 0, 128) + e
                ours = ((lane5 == 0) & (e >= skew5)) | ((lane5 == 15) & (e < skew5))
                byte_ptr = ptr.to(gl.pointer_type(gl.uint8), bitcast=True)
                gl.store(byte_ptr + offset, edge_bytes, mask=(row < rows) & (skew5 > 0) & ours)

    @gluon.jit
    def _funnel_words(word, prev, STORE_MOD: gl.constexpr):
        """Per row, with that row's constant misalignment, both words of :func:`_funnel`."""
        w = _words_by_residue(word)
        p = _words_by_residue(prev)
        f0 = _funnel(w[0], p[0], (0 * STORE_MOD) % 8)
        f1 = _funnel(w[1], p[1], (1 * STORE_MOD) % 8)
        f2 = _funnel(w[2], p[2], (2 * STORE_MOD) % 8)
        f3 = _funnel(w[3], p[3], (3 * STORE_MOD) % 8)
        f4 = _funnel(w[4], p[4], (4 * STORE_MOD) % 8)
        f5 = _funnel(w[5], p[5], (5 * STORE_MOD) % 8)
        f6 = _funnel(w[6], p[6], (6 * STORE_MOD) % 8)
        f7 = _funnel(w[7], p[7], (7 * STORE_MOD) % 8)
        aligned = _words_from_residues(f0[0], f1[0], f2[0], f3[0], f4[0], f5[0], f6[0], f7[0])
        tails = _words_from_residues(f0[1], f1[1], f2[1], f3[1], f4[1], f5[1], f6[1], f7[1])
        return gl.convert_layout(aligned, word.type.layout), gl.convert_layout(tails, word.type.layout)
