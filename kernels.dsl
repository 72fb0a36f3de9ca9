# kernels.dsl -- the kernel library kernelgen builds for SIMD128 and relaxed SIMD.
#
# Pointers are byte addresses in the one shared memory. Target constants differ per target:
#   ACT_ZERO, ACT_MAX  how activations are quantized for the integer dot: int8 in [-127, 127]
#                      stored as is (0, 127), the same values on both targets (never -128: relaxed
#                      SIMD's idots takes |a| in the relaxed dot's 7-bit operand)
#   ACT_BYTES          bytes per stored activation: 2 on simd128 (widened to i16 once, for its
#                      i16 dot), 1 on relaxed SIMD; idot and idot7(acc, w, ptr, offset) read this layout
#   ACT_SPLIT          1 on simd128: each 16 activations stored as the 8 at even positions, then the
#                      8 at odd ones (its idot needs no sign-extend of the weights); 0: in order
#   DOT_SHIFT          idot, idot7 and idot7z of stored activations (ptr, offset) add the dot
#                      shifted left by this (8 on simd128: its split dot is 256 x the dot, 0 on
#                      relaxed SIMD); the kernels shift it out once per group of blocks (qexact)
#   DOT_ADD            1 where the relaxed i32 dot-add is one instruction (relaxed SIMD's vnni flavor,
#                      ops.Flavor: Chromium's vpdpbusd), 0 in every base build: the i16 types take a
#                      block's two halves in idots2's two dot-add chains there (Q.dots2)

# ---- quantization types: stored layouts are llama.cpp's GGUF blocks, byte for byte -------------
# `priority N` weighs a type's speedups when the build's code budget cannot keep every type's
# fastest variant (default 1): Q4_K_M (Q4_K, Q6_K, Q5_0 for rows not a multiple of 256) and Q8_0 are
# what most GGUF downloads hold, Q4_0 and ONNX 4-bit what most browser models ship.

# Q8_0: 32 int8 values and one f16 scale.
quant q8_0 {
    block 32;
    priority 3;
    field d: f16;
    field qs: i8[32];
    unpack qs[i];
    dequant d * q;
}

# Q4_0: 32 4-bit values, elements 0-15 in the low nibbles and 16-31 in the high; value d * (q - 8).
quant q4_0 {
    block 32;
    priority 2;
    field d: f16;
    field qs: u8[16];
    unpack nib(qs, i) - 8;
    dequant d * q;
}

# Q4_1: like Q4_0's nibbles, unsigned, with a minimum: value d * q + m.
quant q4_1 {
    block 32;
    field d: f16;
    field m: f16;
    field qs: u8[16];
    unpack nib(qs, i);
    dequant d * q + m;
}

# Q5_0: Q4_0 with a fifth bit per value in a 32-bit mask: value d * (q - 16), q in 0..31. llama.cpp
# quantizes a Q4_K tensor whose rows are not a multiple of 256 values to Q5_0 instead (most tensors
# of the small models run in browsers: 576-, 896-, 960-wide rows), so a Q4_K_M file holds it.
quant q5_0 {
    block 32;
    priority 2;
    field d: f16;
    field qh: u8[4];
    field qs: u8[16];
    unpack (nib(qs, i) | (bit(qh, i) << 4)) - 16;
    dequant d * q;
}

# Q5_1: Q4_1 with a fifth bit per value in a 32-bit mask: value d * q + m, q in 0..31 (packed for
# the kernels as bytes: QuantFormat.reencoded).
quant q5_1 {
    block 32;
    field d: f16;
    field m: f16;
    field qh: u8[4];
    field qs: u8[16];
    unpack nib(qs, i) | (bit(qh, i) << 4);
    dequant d * q + m;
}

# IQ4_NL's and IQ4_XS's non-linear codebook: 16 int8 values, indexed by a 4-bit code.
table iq4nl_values = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

# IQ4_NL: Q4_0's nibbles index the codebook above: value d * iq4nl_values[code].
quant iq4_nl {
    block 32;
    field d: f16;
    field qs: u8[16];
    unpack iq4nl_values[nib(qs, i)];
    dequant d * q;
}

# MXFP4 (OCP microscaling, gpt-oss): e2m1 codes in Q4_0's nibble order, doubled to integers, under
# an e8m0 power-of-two scale e (bias 127; halved for the doubling): value 2^(e - 128) * kv[code].
quant mxfp4 {
    block 32;
    table kv = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};
    field e: u8;
    field qs: u8[16];
    unpack kv[nib(qs, i)];
    dequant pow2(e - 128) * q;
}

# ---- super-blocks: 256 values in sub-blocks whose scales are stored quantized -------------------
# The kernels see each sub-block of 32 as a block: its integers re-encoded in the narrowest form
# their range allows (4-bit, 5-bit or bytes) and its scale and minimum as f32 (Kernels.pack).

# Q4_K: 8 sub-blocks of 32 4-bit values (two sub-blocks share 32 bytes: low nibbles, then high);
# each has a 6-bit scale and a 6-bit minimum packed into 12 bytes under the f16 d and dmin.
quant q4_k {
    block 256;
    priority 4;
    sub 32;
    field d: f16;
    field dmin: f16;
    field scales: u8[12];
    field qs: u8[128];
    # sub-blocks 0-3: low 6 bits of bytes s and s + 4; 4-7: a nibble of byte s + 4 and the top bits
    # of bytes s - 4 (scale) and s (minimum)
    let sc = select(s < 4, scales[s] & 63, (scales[s + 4] & 15) | (scales[s % 4] >> 6 << 4));
    let mn = select(s < 4, scales[s + 4] & 63, (scales[s + 4] >> 4) | (scales[s] >> 6 << 4));
    unpack (qs[i / 64 * 32 + i % 32] >> (i / 32 % 2 * 4)) & 15;
    dequant d * sc * q - dmin * mn;
}

# Q5_K: Q4_K with a fifth bit per value: bit s of qh[i % 32] for sub-block s.
quant q5_k {
    block 256;
    priority 2;
    sub 32;
    field d: f16;
    field dmin: f16;
    field scales: u8[12];
    field qh: u8[32];
    field qs: u8[128];
    let sc = select(s < 4, scales[s] & 63, (scales[s + 4] & 15) | (scales[s % 4] >> 6 << 4));
    let mn = select(s < 4, scales[s + 4] & 63, (scales[s + 4] >> 4) | (scales[s] >> 6 << 4));
    unpack ((qs[i / 64 * 32 + i % 32] >> (i / 32 % 2 * 4)) & 15) | ((qh[i % 32] >> (i / 32) & 1) << 4);
    dequant d * sc * q - dmin * mn;
}

# Q6_K: 16 sub-blocks of 16 6-bit values, each with an int8 scale under the f16 d. Per half of 128
# values, ql holds the low 4 bits (64 bytes: low nibbles, then high) and qh the top 2 (32 bytes,
# four 2-bit fields); values are offset by 32.
quant q6_k {
    block 256;
    priority 3;
    sub 16;
    field ql: u8[128];
    field qh: u8[64];
    field scales: i8[16];
    field d: f16;
    unpack (((ql[i / 128 * 64 + i % 64] >> (i % 128 / 64 * 4)) & 15)
            | (((qh[i / 128 * 32 + i % 32] >> (i % 128 / 32 * 2)) & 3) << 4)) - 32;
    dequant d * scales[s] * q;
}

# Q3_K (Q3_K_S, Q3_K_M and Q3_K_L files): 16 sub-blocks of 16 3-bit values, each with a 6-bit scale
# stored + 32, under the f16 d; values offset by 4. Element i's two low bits sit in qs byte
# i / 128 * 32 + i % 32 at bit i % 128 / 32 * 2, its third in bit i / 32 of hmask[i % 32] (set: no
# -4); sub-block s's scale has its low nibble in byte s % 8 (nibble s / 8), its top two bits in byte
# 8 + s % 4 at bit s / 4 * 2.
quant q3_k {
    block 256;
    sub 16;
    field hmask: u8[32];
    field qs: u8[64];
    field scales: u8[12];
    field d: f16;
    let sc = ((scales[s % 8] >> (s / 8 * 4)) & 15) | (((scales[8 + s % 4] >> (s / 4 * 2)) & 3) << 4);
    unpack (((qs[i / 128 * 32 + i % 32] >> (i % 128 / 32 * 2)) & 3) | ((hmask[i % 32] >> (i / 32) & 1) << 2)) - 4;
    dequant d * (sc - 32) * q;
}

# Q2_K (Q2_K files; their attention and output tensors are Q3_K to Q6_K): 16 sub-blocks of 16 2-bit
# values, each with a 4-bit scale (the low nibble of scales[s]) and a 4-bit minimum (the high
# nibble) under the f16 d and dmin: value d * sc * q - dmin * m. Element i's bits sit where Q3_K's
# two low bits do. The kernels weigh each half of 16 activations by its minimum (Q.sub_offsets).
quant q2_k {
    block 256;
    sub 16;
    field scales: u8[16];
    field qs: u8[64];
    field d: f16;
    field dmin: f16;
    unpack (qs[i / 128 * 32 + i % 32] >> (i % 128 / 32 * 2)) & 3;
    dequant d * (scales[s] & 15) * q - dmin * (scales[s] >> 4);
}

# IQ4_XS: IQ4_NL's codebook in super-blocks: 8 sub-blocks of 32 4-bit codes (sub-block s in bytes
# 16s..16s+15, low nibbles then high), each with a 6-bit scale, offset by 32: its low 4 bits in
# scales_l (two per byte), its top 2 in scales_h (two bits per sub-block), under the f16 d.
# Plane q holds the codes; the kernels look them up as IQ4_NL's.
quant iq4_xs {
    block 256;
    sub 32;
    field d: f16;
    field scales_h: u16;
    field scales_l: u8[4];
    field qs: u8[128];
    let ls = ((scales_l[s / 2] >> (s % 2 * 4)) & 15) | (((scales_h >> (s * 2)) & 3) << 4);
    unpack iq4nl_values[(qs[i / 32 * 16 + i % 16] >> (i % 32 / 16 * 4)) & 15];
    dequant d * (ls - 32) * q;
}

# ONNX 4-bit (MatMulNBits, or blocked DequantizeLinear; block 32 along K): an f32 scale, a UINT4
# zero point, and UINT4 values two per byte, element 2i in the low nibble; value d * (q - z).
# kernelgen.host.formats gathers these blocks from either node's tensors.
quant q4_onnx {
    block 32;
    priority 2;
    field d: f32;
    field z: u8;
    field qs: u8[16];
    unpack nibi(qs, i) - z;
    dequant d * q;
}

# ---- f32 ---------------------------------------------------------------------------------------

# Dot product of n f32 values, `U` vector accumulators, a scalar loop for the tail.
inline kernel fdot[U: i32](x: ptr, y: ptr, n: i32) -> f32 {
    var acc[U]: f32x4 = f32x4.splat(0.0);
    let body = n - n % (4 * U);
    for i in 0..body step 4 * U {
        unroll u in 0..U {
            acc[u] = madd(f32x4.load(x + i * 4, u * 16), f32x4.load(y + i * 4, u * 16), acc[u]);
        }
    }
    unroll u in 1..U {
        acc[0] = acc[0] + acc[u];
    }
    var s: f32 = hsum(acc[0]);
    for i in body..n {
        s = s + f32.load(x + i * 4) * f32.load(y + i * 4);
    }
    return s;
}

# x . y over n f32 values.
#   x: f32[n]
#   y: f32[n]
#   n: element count, any value >= 0
export kernel dot_f32(x: ptr, y: ptr, n: i32) -> f32 {
    tune unroll: i32 in {1, 2, 4} = 2;
    return fdot[unroll](x, y, n);
}

# Rows r0 .. r1 - 1 of y = W x.
kernel fmatvec_rows[U: i32](w: ptr, x: ptr, y: ptr, r0: i32, r1: i32, k: i32) {
    for r in r0..r1 {
        f32.store(y + r * 4, fdot[U](w + r * k * 4, x, k));
    }
}

# y = W x for a row-major f32 matrix.
#   w: f32[rows, k], row-major
#   x: f32[k]
#   y: f32[rows], written
#   rows: row count
#   k: row length, any value >= 0
export kernel matvec_f32(w: ptr, x: ptr, y: ptr, rows: i32, k: i32) {
    tune unroll: i32 in {1, 2, 4} = 4;  # the store's pick on both targets here (AMD EPYC, 2 cores)
    parallel rows r0..r1 in 0..rows;
    fmatvec_rows[unroll](w, x, y, r0, r1, k);
}

# ---- f32 matrix products (attention: scores = Q K^T, out = P V) --------------------------------
#
# Both forms tile M rows of A (tokens) by N columns of y, their accumulators side by side in
# registers; each tile's loads of B are shared by its tokens and its loads of A by its columns.
# The tails go one output (or one vector of four) at a time with the same order, so no result
# depends on the tiling or on how rows are split over threads.

# y[t, r] = A[t, :] . B[r, :] for tokens t0 .. t0 + M - 1 and rows r0 .. r0 + N - 1 of B. Order of
# each dot: four lane sums (lane j adds the products i = j mod 4 in order of i, each product
# rounded, then added), hsum's pairs ((0 + 1) + (2 + 3)), then the k % 4 tail products in order.
# A multiply and an add, not madd: wasmtime's x86 lowering of relaxed_madd overwrites a factor, so
# each of a tile's shared A and B vectors is copied before every use (12-14 register moves per 8
# multiply-adds, seen in the disassembly); mul and add leave the factors alone. The loop keeps only
# the M + N row pointers and one byte offset live, counting up to 0 from below (the pointers start
# past the whole vectors, where the tail begins): with an index, its bound and the output's
# coordinates too, cranelift ran out of integer registers for a 4 x 2 tile and carried a pointer
# through a stack slot from one pass to the next.
inline kernel ftile_nt[M: i32, N: i32](a: ptr, b: ptr, y: ptr, t0: i32, r0: i32, n: i32, k: i32) {
    var acc[M * N]: f32x4 = f32x4.splat(0.0);
    var bv[N]: f32x4 = f32x4.splat(0.0);
    let tail = k % 4;
    let body = (k - tail) * 4;  # bytes of whole vectors in a row
    var brow[N]: ptr = 0;
    unroll r in 0..N {
        brow[r] = b + (r0 + r) * k * 4 + body;
    }
    var arow[M]: ptr = 0;
    unroll t in 0..M {
        arow[t] = a + (t0 + t) * k * 4 + body;
    }
    let yt = y + (t0 * n + r0) * 4;  # y[t0, r0]
    var i: i32 = -body;
    while i < 0 {
        unroll r in 0..N {
            bv[r] = f32x4.load(brow[r] + i);
        }
        unroll t in 0..M {
            let av = f32x4.load(arow[t] + i);
            unroll r in 0..N {
                acc[t * N + r] = acc[t * N + r] + av * bv[r];
            }
        }
        i = i + 16;
    }
    # The lane sums, four outputs' at once (same order as one hsum each), in one vector store where
    # they sit side by side in y; then the k % 4 tail products onto each output in order.
    unroll g in 0..M * N / 4 {
        let v = hsum(acc[4 * g], acc[4 * g + 1], acc[4 * g + 2], acc[4 * g + 3]);
        if N % 4 == 0 {
            f32x4.store(yt + (4 * g / N * n + 4 * g % N) * 4, v);
        } else {
            unroll u in 0..4 {
                let j = 4 * g + u;
                f32.store(yt + (j / N * n + j % N) * 4, extract(v, u));
            }
        }
    }
    unroll j in M * N - M * N % 4..M * N {
        f32.store(yt + (j / N * n + j % N) * 4, hsum(acc[j]));
    }
    if tail > 0 {
        unroll j in 0..M * N {
            let out = yt + (j / N * n + j % N) * 4;
            var s: f32 = f32.load(out);
            for c in 0..tail * 4 step 4 {  # c: bytes past the row pointers, at the tail
                s = s + f32.load(arow[j / N] + c) * f32.load(brow[j % N] + c);
            }
            f32.store(out, s);
        }
    }
}

# Tokens t0 .. t1 - 1 of y = A B^T: tiles of MR tokens x NR rows of B, the rest one dot at a time.
kernel ftiles_nt[MR: i32, NR: i32](a: ptr, b: ptr, y: ptr, t0: i32, t1: i32, n: i32, k: i32) {
    let tfull = t1 - (t1 - t0) % MR;
    let rfull = n - n % NR;
    for t in t0..tfull step MR {
        for r in 0..rfull step NR {
            ftile_nt[MR, NR](a, b, y, t, r, n, k);
        }
        for tt in t..t + MR {
            for r in rfull..n {
                ftile_nt[1, 1](a, b, y, tt, r, n, k);
            }
        }
    }
    for t in tfull..t1 {
        for r in 0..n {
            ftile_nt[1, 1](a, b, y, t, r, n, k);
        }
    }
}

# y = A B^T (attention scores: Q K^T), both operands row-major with k the shared inner dimension.
# Each output is one dot in ftile_nt's order, where a product passes through at most k / 4 + 6
# roundings (its own, its lane's adds, hsum's two, the tail's three), each of at most 2^-24 of a
# partial sum of |a_i b_i|: |error| <= (k / 4 + 6) * 2^-24 * sum |a_i b_i| (to first order).
#   a: f32[m, k], row-major
#   b: f32[n, k], row-major
#   y: f32[m, n], written
#   m: rows of a
#   n: rows of b
#   k: row length of both, any value >= 0
export kernel matmul_f32_nt(a: ptr, b: ptr, y: ptr, m: i32, n: i32, k: i32) {
    tune tokens: i32 in {1, 2, 4} = 4;
    tune rows: i32 in {1, 2, 4} = 2;
    restrict tokens * rows + rows < 16;  # accumulators and B's vectors in 16 registers, one for A's
    parallel rows t0..t1 in 0..m;  # rows of a (and of y)
    ftiles_nt[tokens, rows](a, b, y, t0, t1, n, k);
}

# y[t, c0 .. c0 + 4N - 1] = A[t, :] B[:, c0 ..] for tokens t0 .. t0 + M - 1: N vectors of four
# columns per token. Order of each output: the k products in order of i, each rounded, then added
# (a multiply and an add, not madd: see ftile_nt).
kernel ftile_nn[M: i32, N: i32](a: ptr, b: ptr, y: ptr, t0: i32, c0: i32, n: i32, k: i32) {
    var acc[M * N]: f32x4 = f32x4.splat(0.0);
    var bv[N]: f32x4 = f32x4.splat(0.0);
    var arow[M]: ptr = 0;
    unroll t in 0..M {
        arow[t] = a + (t0 + t) * k * 4;
    }
    var brow: ptr = b + c0 * 4;  # row i of B's columns c0 ..
    for i in 0..k * 4 step 4 {  # i: bytes
        unroll c in 0..N {
            bv[c] = f32x4.load(brow, c * 16);
        }
        unroll t in 0..M {
            let av = f32x4.splat(f32.load(arow[t] + i));
            unroll c in 0..N {
                acc[t * N + c] = acc[t * N + c] + av * bv[c];
            }
        }
        brow = brow + n * 4;
    }
    unroll j in 0..M * N {
        f32x4.store(y + ((t0 + j / N) * n + c0) * 4, (j % N) * 16, acc[j]);
    }
}

# y[t, c] for one token and one column in ftile_nn's order (the n % 4 columns past the vectors).
kernel fcol_nn(a: ptr, b: ptr, y: ptr, t: i32, c: i32, n: i32, k: i32) {
    var s: f32 = 0.0;
    for i in 0..k {
        s = s + f32.load(a + (t * k + i) * 4) * f32.load(b + (i * n + c) * 4);
    }
    f32.store(y + (t * n + c) * 4, s);
}

# Tokens t0 .. t1 - 1 of y = A B: tiles of MR tokens x NR vectors of columns, the rest one vector
# (or, past the last whole vector, one column) at a time.
kernel ftiles_nn[MR: i32, NR: i32](a: ptr, b: ptr, y: ptr, t0: i32, t1: i32, n: i32, k: i32) {
    let tfull = t1 - (t1 - t0) % MR;
    let nv = n / 4;
    let vfull = nv - nv % NR;
    for t in t0..tfull step MR {
        for v in 0..vfull step NR {
            ftile_nn[MR, NR](a, b, y, t, v * 4, n, k);
        }
        for tt in t..t + MR {
            for v in vfull..nv {
                ftile_nn[1, 1](a, b, y, tt, v * 4, n, k);
            }
        }
    }
    for t in tfull..t1 {
        for v in 0..nv {
            ftile_nn[1, 1](a, b, y, t, v * 4, n, k);
        }
    }
    for t in t0..t1 {
        for c in nv * 4..n {
            fcol_nn(a, b, y, t, c, n, k);
        }
    }
}

# y = A B (attention output: P V), both row-major, k the inner dimension (A's columns, B's rows).
# Each output sums its k products in order (a product's own rounding and up to k - 1 adds):
# |error| <= (k + 1) * 2^-24 * sum |a_i b_i| (to first order).
#   a: f32[m, k], row-major
#   b: f32[k, n], row-major
#   y: f32[m, n], written
#   m: rows of a
#   n: columns of b
#   k: columns of a, rows of b
export kernel matmul_f32_nn(a: ptr, b: ptr, y: ptr, m: i32, n: i32, k: i32) {
    tune tokens: i32 in {1, 2, 4, 8} = 4;
    tune cols: i32 in {1, 2, 4} = 2;
    restrict tokens * cols + cols < 16;  # accumulators and B's vectors in 16 registers, one for A's
    parallel rows t0..t1 in 0..m;  # rows of a (and of y)
    ftiles_nn[tokens, cols](a, b, y, t0, t1, n, k);
}

# ---- activations -------------------------------------------------------------------------------

# Where quantize_act stores its blocks' sums: after all the scales (d + blocks * 4, blocks the
# call's block count), one i32 per block of 32: sum(a), which the kernels need, where a type has a
# zero or a minimum, once per activation block instead of once per weight row.
inline kernel act_sums(d: ptr, blocks: i32) -> ptr {
    return d + blocks * 4;
}

# Blocks b0 .. b1 - 1 of quantize_act of n values.
kernel quantize_blocks(x: ptr, n: i32, q: ptr, d: ptr, b0: i32, b1: i32) {
    let s = act_sums(d, n / 32);
    for b in b0..b1 {
        let xb = x + b * 128;
        var m: f32x4 = f32x4.splat(0.0);
        unroll j in 0..8 {
            m = max(m, abs(f32x4.load(xb, j * 16)));
        }
        let scale = hmax(m) / f32(ACT_MAX);
        f32.store(d + b * 4, scale);
        var inv: f32 = 0.0;
        if scale != 0.0 {
            inv = 1.0 / scale;
        }
        let vinv = f32x4.splat(inv);
        let lim = f32x4.splat(f32(ACT_MAX));
        var sum: i32x4 = i32x4.splat(0);
        unroll h in 0..2 {
            var v[4]: i32x4 = i32x4.splat(0);
            unroll j in 0..4 {
                let xs = f32x4.load(xb, h * 64 + j * 16) * vinv;
                v[j] = i32x4.trunc_sat(nearest(min(max(xs, -lim), lim)));
            }
            sum = sum + (v[0] + v[1]) + (v[2] + v[3]);
            static if ACT_SPLIT == 1 {  # even positions, then odd (ACT_BYTES is 2)
                let even = i16x8.narrow(i32x4.shuffle(v[0], v[1], 0, 2, 4, 6), i32x4.shuffle(v[2], v[3], 0, 2, 4, 6));
                let odd = i16x8.narrow(i32x4.shuffle(v[0], v[1], 1, 3, 5, 7), i32x4.shuffle(v[2], v[3], 1, 3, 5, 7));
                i16x8.store(q + b * 64, h * 32, even + ACT_ZERO);
                i16x8.store(q + b * 64, h * 32 + 16, odd + ACT_ZERO);
            } else {
                let lo = i16x8.narrow(v[0], v[1]);
                let hi = i16x8.narrow(v[2], v[3]);
                static if ACT_BYTES == 2 {
                    i16x8.store(q + b * 64, h * 32, lo + ACT_ZERO);
                    i16x8.store(q + b * 64, h * 32 + 16, hi + ACT_ZERO);
                } else {
                    i8x16.store(q + b * 32, h * 16, i8x16.narrow(lo, hi) + ACT_ZERO);
                }
            }
        }
        i32.store(s + b * 4, hsum(sum));
    }
}

# Quantize activations per block of 32 for the integer dot: d = amax / ACT_MAX,
# q = nearest(x / d) clamped to +-ACT_MAX (NaN -> 0), stored as q + ACT_ZERO in ACT_BYTES, and
# each block's sum of q (act_sums).
#   x: f32[n]
#   n: element count, a multiple of 32
#   q: i8[n * ACT_BYTES], written: the values, i16 on simd128, i8 on relaxed SIMD
#   d: f32[n / 32] then i32[n / 32], written: the block scales, then the blocks' sums
export kernel quantize_act(x: ptr, n: i32, q: ptr, d: ptr) {
    parallel blocks b0..b1 in 0..n / 32;
    quantize_blocks(x, n, q, d, b0, b1);
}

# Lanes J (8 values) of the stored activation block at q, as i16 (ACT_BYTES 2: SIMD128's; 1:
# relaxed SIMD's bytes, sign-extended), less ACT_ZERO.
inline kernel act_lanes[J: i32](q: ptr) -> i16x8 {
    static if ACT_BYTES == 2 {
        return i16x8.load(q, J * 16) - i16x8.splat(ACT_ZERO);
    } else {
        return i16x8.load8x8(q, J * 8) - i16x8.splat(ACT_ZERO);
    }
}

# The first of the n / 32 blocks of stored activations at q (quantize_act's form) whose values
# leave [-ACT_MAX, ACT_MAX] or do not sum to the block's stored sum, or -1. The kernels trust
# both (relaxed SIMD reads |a| in 7 bits; a weight type's zero or minimum comes off with the sums):
# the hosts check activations they did not make with it (a JavaScript loop over k = 4096 values
# took 8 us, 13% of a relaxed Q8_0 qmatvec at 256x4096 in Node).
#   q: i8[n * ACT_BYTES], the values (ACT_BYTES each)
#   d: f32[n / 32] then i32[n / 32], the blocks' scales, then their sums (act_sums)
#   n: value count, a multiple of 32
export kernel act_check(q: ptr, d: ptr, n: i32) -> i32 {
    let s = act_sums(d, n / 32);
    var first: i32 = -1;
    for b in 0..n / 32 {
        var sum: i32x4 = i32x4.splat(0);
        var over: i16x8 = i16x8.splat(0);  # lane-wise max of |a| - ACT_MAX and 0 (|-32768| wraps: over too)
        unroll j in 0..4 {
            let v = act_lanes[j](q + b * 32 * ACT_BYTES);
            sum = sum + pairsum(v);
            over = max(over, abs(v) - i16x8.splat(ACT_MAX));
        }
        if (first < 0) & ((hsum(pairsum(over)) > 0) | (hsum(sum) != i32.load(s + b * 4))) {
            first = b;
        }
    }
    return first;
}

# ---- quantized dot products and mat-vec, generic over quant types -------------------------------
#
# Weights are packed once (Kernels.pack) into planes: w.q (values), w.scale (f32 per block) and,
# for types with an offset term, w.offset; a super-block type's w.scale holds one record per
# super-block instead (its f16 factors and byte-sized sub-block integers: Q4_K 3 bytes per 32
# values, not 8). Q.scale4(w, blk) and Q.offset4 read the f32s of four blocks from a multiple of 4,
# Q.scale1 and Q.offset1 of one, from either layout. Activations come in blocks of 32
# (quantize_act), so these kernels take quant types whose block is 32. This section's kernels read
# rows one by one (Q.group 1); where a target packs a type in groups of rows (Q.group > 1: relaxed
# SIMD's i7 types), qmatvec and qmatmul take the grouped section's kernels below instead.
#
# The integer dots are exact on both targets, with the same int8 activations: on relaxed SIMD a
# type whose values are codes - zero with codes and zero in [0, 127] (Q.dot7: every 4-, 5- and
# 6-bit type; the manifest's "dot": "i7") puts the codes in the 7-bit operand of the relaxed dot
# (idot7); Q8_0 and IQ4_NL (8-bit signed values, "i16") take the i16 dot of simd128 (idot). A
# constant zero that multiplies whole blocks (Q.block_zero: Q4_0's 8 and on relaxed SIMD MXFP4's
# 12) is removed per block, zero * sum(a) with the sums quantize_act stored (qscale4); the others
# in each half (idot7z) or in the unpacked values: Q6_K's under sub-block scales, and q4_onnx's
# zero point, a byte of each block (gathering four blocks' zeros into a vector cost what the sums
# saved, measured). Either way w . a is exact, so both targets' dots are equal.
#
# S, below: 1 in the four-block steps, whose lanes are summed in integers (exact in any split):
# the dots are of the codes with a block zero left for qscale4, and the i16 types take idots; 0 in
# qstep1, whose lanes are converted to float one by one (a single block's float sum is over its
# lanes, so their split is part of its order): the values' products in idot's lanes.

# The lanes of half h of a block (16 values) that qhalf multiplies: the codes on the i7 scheme or
# for a block zero under S, else the values.
inline kernel qlanes[Q: quant, S: i32](wq: ptr, h: i32) -> i8x16 {
    static if Q.dot7 | S * Q.block_zero {
        return Q.codes(wq, h);
    } else {
        return Q.unpack(wq, h);
    }
}

# acc plus the integer dot of half h's lanes wv (qlanes) with its activations (a: the block's):
# exact, and with a block zero left in only under S.
inline kernel qdot16[Q: quant, S: i32](acc: i32x4, wv: i8x16, wq: ptr, a: ptr, h: i32) -> i32x4 {
    static if Q.dot7 {
        static if Q.has_zero > S * Q.block_zero {
            return idot7z(acc, wv, Q.zeros(wq, h), a, h * 16);
        } else {
            return idot7(acc, wv, a, h * 16);
        }
    } else {
        static if S {
            return idots(acc, wv, a, h * 16);
        } else {
            return idot(acc, wv, a, h * 16);
        }
    }
}

# One block's integer dot w . a in i32 lanes whose sum is the dot: wq points at the block's packed
# codes, a at its activations. Types with sub-blocks of 16 (Q6_K) multiply each half's dot by its
# integer scale, two i32 stored after the codes (Q.sub_scales_at).
# The first half's dot starts the sum: engines keep an add of a zero vector (7% of simd128 qmatvec).
# Codes of at most 64 (Q.pair16) take both halves in one dot, idot7p: its i16 pair sums of the two
# halves added before one widening (relaxed Q4_0/Q4_K/Q5_K/MXFP4 qmatvec 1.12-1.17x in wasmtime,
# 1.30-1.33x in Node 20; 0.88-0.95x in Chromium 156, whose relaxed i32 dot is one vpdpbusd).
inline kernel qraw[Q: quant, S: i32](wq: ptr, a: ptr) -> i32x4 {
    static if Q.pair16 * (Q.has_zero <= S * Q.block_zero) {  # the codes' dot (qdot16's idot7) of both halves at once
        return idot7p(i32x4.splat(0), qlanes[Q, S](wq, 0), qlanes[Q, S](wq, 1), a, 0);
    } else static if Q.nib16 * (Q.has_zero <= S * Q.block_zero) {  # both halves' codes from the nibbles at once
        return idotn(i32x4.splat(0), i8x16.load(wq), a);
    } else static if Q.nibss * S * (Q.const_zero == 0) {  # both halves under their sub-block scales, from the nibbles
        return idotns(i32x4.splat(0), i8x16.load(wq), wq + Q.sub_scales_at, a);
    } else static if Q.sub16 * S {  # both halves under their sub-block scales in one widening dot
        return idotss(i32x4.splat(0), qlanes[Q, S](wq, 0), qlanes[Q, S](wq, 1), wq + Q.sub_scales_at, a);
    } else static if Q.dots2 * S {  # both halves' sign parts in two dot-add chains (DOT_ADD)
        return idots2(i32x4.splat(0), qlanes[Q, S](wq, 0), qlanes[Q, S](wq, 1), a, 0);
    } else {
        var acc: i32x4 = qhalf[Q, S](i32x4.splat(0), qlanes[Q, S](wq, 0), wq, a, 0);
        unroll h in 1..Q.block / 16 {
            acc = qhalf[Q, S](acc, qlanes[Q, S](wq, h), wq, a, h);
        }
        return acc;
    }
}

# acc plus half h (16 values) of one block's integer dot: wv the half's unpacked codes, wq the
# block's packed codes, a its activations. For types with sub-block scales (Q.has_sub_scales) each
# half's dot is multiplied by its integer scale, stored after the codes (Q.sub_scales_at, an i32
# holding it in both i16 halves) inside the widening i16 dot, idot7zs, on relaxed SIMD's i7 scheme
# (Q6_K qmatvec 1.46x faster than with an i32 multiply after the dot) and on SIMD128, where vector
# multiplies are the bound: three per 16 values either way, against Q4_0's two. The four-block
# steps of SIMD128 there take both halves in one dot instead (Q.sub16: idotss in qraw and qtile),
# five multiplies per 32. The one
# place a block's integer dot is formed: qraw and the GEMM tiles (qtile) both add halves with it.
# Its sums are "raw": see qexact (a sub-scaled half is made exact before its multiply: the
# product with 2^DOT_SHIFT could overflow i32).
inline kernel qhalf[Q: quant, S: i32](acc: i32x4, wv: i8x16, wq: ptr, a: ptr, h: i32) -> i32x4 {
    static if Q.has_sub_scales * Q.dot7 {  # the scale rides the widening i16 dot: no i32 multiply
        return idot7zs(acc, wv, Q.zeros(wq, h), wq + Q.sub_scales_at + h * 4, a, h * 16);
    } else static if Q.has_sub_scales * ACT_SPLIT {  # SIMD128: wv holds the values (qlanes), any int8
        return idot7zs(acc, wv, i8x16.splat(0), wq + Q.sub_scales_at + h * 4, a, h * 16);
    } else static if Q.has_sub_scales {  # relaxed SIMD, values that are no 7-bit codes: idots, then the scale
        return acc + (qdot16[Q, S](i32x4.splat(0), wv, wq, a, h) >> DOT_SHIFT) * i32x4.splat(i32.load(wq + Q.sub_scales_at + h * 4) >> 16);
    } else {
        return qdot16[Q, S](acc, wv, wq, a, h);
    }
}

# The exact integer dots from raw sums of qhalf: 2^DOT_SHIFT x the dot (idot's stored-activation
# form), except for sub-scaled types (exact per half). Shifted once per group of blocks, after every
# lane add: a lane then holds at most one block's 32 products |a| * |w| * 2^DOT_SHIFT <=
# 127 * 128 * 256 each, 32 * 4161536 < 2^28 in magnitude, and the shift of a multiple of 2^DOT_SHIFT
# is exact.
inline kernel qexact[Q: quant](raw: i32x4) -> i32x4 {
    static if Q.has_sub_scales {
        return raw;
    } else {
        return raw >> DOT_SHIFT;
    }
}

# Two vectors -> one whose lanes 0, 1 sum to a's lanes and lanes 2, 3 to b's (half of a transpose).
inline kernel lanepairs(a: i32x4, b: i32x4) -> i32x4 {
    return i32x4.shuffle(a, b, 0, 4, 1, 5) + i32x4.shuffle(a, b, 2, 6, 3, 7);
}

# Two lanepairs results -> one vector whose lane i is the sum of the ith original vector's lanes.
inline kernel lanequads(ab: i32x4, cd: i32x4) -> i32x4 {
    return i32x4.shuffle(ab, cd, 0, 1, 4, 5) + i32x4.shuffle(ab, cd, 2, 3, 6, 7);
}

# The dots of blocks blk .. blk + 3 of one row (codes, under Q.block_zero), lane i for block
# blk + i: their scales then apply as one vector, a quarter of the per-block scalar work of
# qstep1. Two blocks per pass of a run-time loop: an engine computes each pass's dots before the
# loop's back edge, so only two blocks' loads are live at once (all four unrolled, cranelift places
# the pure arithmetic after all the loads and spills vectors to the stack).
inline kernel qdots4[Q: quant](w: packed Q, blk: i32, a: ptr) -> i32x4 {
    var p[2]: i32x4 = i32x4.splat(0);
    var wq: ptr = w.q + blk * Q.bytes;
    var ap: ptr = a;
    for i in 0..2 {
        let x = lanepairs(qraw[Q, 1](wq, ap), qraw[Q, 1](wq + Q.bytes, ap + Q.block * ACT_BYTES));
        p[0] = p[1];
        p[1] = x;
        wq = wq + 2 * Q.bytes;
        ap = ap + 2 * Q.block * ACT_BYTES;
    }
    return qexact[Q](lanequads(p[0], p[1]));
}

# One activation block's sum in lanes that sum to it, for a single block of a type with an offset
# term (S * q + M): qstep1's float order is over these lanes (the four-block steps read the stored
# sums, asums4).
inline kernel ablock[Q: quant](a: ptr) -> i32x4 {
    var acc: i32x4 = i32x4.splat(0);
    unroll j in 0..Q.block / 16 {
        acc = idot7(acc, i8x16.splat(1), a, j * 16);
    }
    return acc >> DOT_SHIFT;
}

# Lanes that sum to half H's (16 values') activation sum of the block at a: for offsets over
# sub-blocks of 16 (Q.sub_offsets), whose integers weigh each half's sum.
inline kernel ahalf[H: i32](a: ptr) -> i32x4 {
    return idot7(i32x4.splat(0), i8x16.splat(1), a, H * 16) >> DOT_SHIFT;
}

# The integers of a sub-block offset (Q.sub_offsets: Q2_K's minimums m of 16 values each) that
# follow block blk in a record (rec: Q.record, Q.rowrecord), two bytes per block and row as i16
# lanes: rows one by one, blocks blk .. blk + 3's m_lo, m_hi in lanes 2i, 2i + 1 (blk a multiple of
# 4: within the record); in the grouped layout, block blk's of row r in lanes 2r, 2r + 1.
inline kernel qmins[Q: quant](rec: ptr, blk: i32) -> i16x8 {
    return i16x8.load8x8(rec + (blk & (Q.record_blocks - 1)) * Q.group * 2, Q.offset_ints_at);
}

# The halves' activation sums of blocks blk .. blk + 3 (a: block blk's; s4: the four blocks' sums,
# asums4, so each high half's is the sum less the low half's) as i16 pairs, block i's in lanes 2i,
# 2i + 1 (narrow: exact, |sum| <= 16 * 127): a token's, formed once for all the rows of a tile
# (qtile), not per row (engines do not merge the loads of equal activations, so neither the dots
# that follow them: simd128 Q2_K qmatvec rows 4 recomputed them four times). The low sums' lanes
# fold as qdots4's dots.
inline kernel ahalves4[Q: quant](a: ptr, s4: i32x4) -> i16x8 {
    let lo = lanequads(lanepairs(ahalf[0](a), ahalf[0](a + Q.block * ACT_BYTES)),
                       lanepairs(ahalf[0](a + 2 * Q.block * ACT_BYTES), ahalf[0](a + 3 * Q.block * ACT_BYTES)));
    return i16x8.bits(i8x16.shuffle(i8x16.bits(i16x8.narrow(lo, s4 - lo)), i8x16.splat(0),
                                    0, 1, 8, 9, 2, 3, 10, 11, 4, 5, 12, 13, 6, 7, 14, 15));
}

# The stored sums of four activation blocks (lane i: block i; s: the first's, act_sums), for types
# with an offset or a block zero; zeros for the others (nothing loaded).
inline kernel asums4[Q: quant](s: ptr) -> i32x4 {
    static if Q.has_offset | Q.block_zero {
        return i32x4.load(s);
    } else {
        return i32x4.splat(0);
    }
}

# acc plus blocks blk .. blk + 3 of a row given their dots (lane i: block blk + i; of the codes
# under Q.block_zero) and their activations' scales and sums (asums4): the sum of scale * d_a *
# (dot - zero * sum(a)) (+ offset * d_a * sum(a)). The zero comes off in integers (exact), the
# rest are the float operations of every quantized dot, in the order that qmatvec and qmatmul
# share. An offset over sub-blocks of 16 (Q.sub_offsets) comes next, from qmins4f.
inline kernel qscale4[Q: quant](w: packed Q, blk: i32, dots: i32x4, da4: f32x4, s4: i32x4, acc: f32x4) -> f32x4 {
    var exact: i32x4 = dots;
    static if Q.block_zero {
        exact = dots - i32x4.splat(Q.zero) * s4;
    }
    var r: f32x4 = madd(f32x4.convert(exact), Q.scale4(w, blk) * da4, acc);
    static if Q.has_offset > Q.sub_offsets {
        r = madd(f32x4.convert(s4) * da4, Q.offset4(w, blk), r);
    }
    return r;
}

# acc (the blocks' qscale4: a call's operands are formed in order, so it comes first) plus the
# offsets over sub-blocks of 16 (Q.sub_offsets) of blocks blk .. blk + 3 of a row: m_lo * sum(a_lo)
# + m_hi * sum(a_hi) per block, exact (at most 2 * 127 * 16 * 127), from the halves' sums
# (ahalves4) and the row's integers (qmins), then F * d_a (Q.offset4 is F there).
inline kernel qmins4f[Q: quant](w: packed Q, blk: i32, acc: f32x4, halves: i16x8, da4: f32x4) -> f32x4 {
    let mins = pairsum(halves, qmins[Q](Q.record(w, blk), blk));
    return madd(f32x4.convert(mins) * da4, Q.offset4(w, blk), acc);
}

# acc plus blocks blk .. blk + 3 of a row (s: the first activation block's sum).
inline kernel qstep4[Q: quant](w: packed Q, blk: i32, a: ptr, da4: f32x4, s: ptr, acc: f32x4) -> f32x4 {
    static if Q.sub_offsets {
        return qmins4f[Q](w, blk, qscale4[Q](w, blk, qdots4[Q](w, blk, a), da4, asums4[Q](s), acc),
                          ahalves4[Q](a, asums4[Q](s)), da4);
    } else {
        return qscale4[Q](w, blk, qdots4[Q](w, blk, a), da4, asums4[Q](s), acc);
    }
}

# acc plus the single block blk of a row (the blocks left over past a multiple of four).
inline kernel qstep1[Q: quant](w: packed Q, blk: i32, a: ptr, da: f32, acc: f32x4) -> f32x4 {
    var r: f32x4 = madd(f32x4.convert(qexact[Q](qraw[Q, 0](w.q + blk * Q.bytes, a))), f32x4.splat(Q.scale1(w, blk) * da), acc);
    static if Q.sub_offsets {  # the block's m_lo, m_hi: bytes of the i32 that holds them (within the record)
        let m = i32.load(Q.record(w, blk) + blk % Q.record_blocks / 2 * 4, Q.offset_ints_at) >> (blk % 2 * 16);
        let mins = ahalf[0](a) * i32x4.splat(m & 255) + ahalf[1](a) * i32x4.splat((m >> 8) & 255);
        r = madd(f32x4.convert(mins), f32x4.splat(Q.offset1(w, blk) * da), r);
    } else static if Q.has_offset {
        r = madd(f32x4.convert(ablock[Q](a)), f32x4.splat(Q.offset1(w, blk) * da), r);
    }
    return r;
}

# acc plus blocks blk .. blk + count - 1 of a row, one at a time (qstep1): the blocks of a dot left
# over past its four-block steps. One function per quant type that every dot of qrowsum and the
# tiles calls, not a copy of qstep1 per dot in each tile (M * N copies: 1.2 KB of each type's
# simd128 1 x 4 tile). Only a K of 1 .. 4 * A - 1 blocks past a multiple of 4 * A has any.
kernel qleft[Q: quant](w: packed Q, blk: i32, a: ptr, ad: ptr, count: i32, acc: f32x4) -> f32x4 {
    var r: f32x4 = acc;
    for b in 0..count {
        r = qstep1[Q](w, blk + b, a + b * Q.block * ACT_BYTES, f32.load(ad + b * 4), r);
    }
    return r;
}

# Row r's dot with the activations: blocks four at a time with A accumulators taking turns, then
# the leftover blocks one at a time (qleft). One body serves every single dot of qmatvec and qmatmul; the
# hosts' qdot is qmatvec of one row (an export of its own was a second copy of this body in every
# quant type's code: 16.6 KB of simd128's 54 KB). Inline: a call per row (stack-passed arguments,
# callee-saved registers, the stack check) cost qmatvec 0.66x the seed-style kernel at k = 1024
# and ~10% at k = 4096 (simd128, wasmtime).
inline kernel qrowsum[Q: quant, A: i32](w: packed Q, aq: ptr, ad: ptr, as: ptr, r: i32, nb: i32) -> f32 {
    var acc[A]: f32x4 = f32x4.splat(0.0);
    let nbs = nb - nb % (4 * A);
    for b in 0..nbs step 4 * A {
        unroll s in 0..A {
            let ab = aq + (b + 4 * s) * Q.block * ACT_BYTES;
            acc[s] = qstep4[Q](w, r * nb + b + 4 * s, ab, f32x4.load(ad + (b + 4 * s) * 4), as + (b + 4 * s) * 4, acc[s]);
        }
    }
    if nbs < nb {
        acc[0] = qleft[Q](w, r * nb + nbs, aq + nbs * Q.block * ACT_BYTES, ad + nbs * 4, nb - nbs, acc[0]);
    }
    unroll s in 1..A {
        acc[0] = acc[0] + acc[s];
    }
    return hsum(acc[0]);
}

# The M x N dots (M * N > 1; single dots are qsingles') of tokens t0 .. t0 + M - 1 with rows
# r0, r0 + rs, .., r0 + (N - 1) * rs of W (rs: qtiles' slab length), their accumulators side by side in registers (M * N * A of them). Each four-block step is a small integer GEMM:
# every weight vector is unpacked once for the M tokens, every activation vector serves the N rows
# (the compiler loads it once: V8 does not merge equal loads), one block per round of a run-time
# loop, each round's raw dots folded in pairs of dots by lanepairs, then lanequads and a shuffle
# per pair after the four rounds; the exact dots then go through qscale4, the float operations of
# qstep4. One block a round: engines issue a round's loads before its arithmetic, and V8 (15
# vector registers to cranelift's 16) spilled with two blocks' loads in flight (qmatvec Q8_0 with
# NR = 2 at 256x4096, simd128: 0.8x the seed-style kernel in V8, 1.2x now; wasmtime 1.22x -> 1.24x,
# its 2x2 GEMM tile 1.28x faster; bits unchanged). M * N is even (tiles of 1, 2 or 4 with M * N > 1),
# so the dots pair up. Integer sums are exact in any order, and the float order is qrowsum's (A
# accumulators taking turns over the four-block steps, qleft for the leftover blocks), so no
# result depends on M or N: row t of qmatmul is qmatvec of token t, bit for bit.
#   token t's activations: aq + t * nb * Q.block * ACT_BYTES, its scales ad + t * nb * 4, its
#   blocks' sums as + t * nb * 4
#   y[t, r] at y + (t * n + r) * 4
kernel qtile[Q: quant, M: i32, N: i32, A: i32](w: packed Q, aq: ptr, ad: ptr, as: ptr, y: ptr, t0: i32, r0: i32, rs: i32, nb: i32, n: i32) {
    var acc[M * N * A]: f32x4 = f32x4.splat(0.0);
    var wv[N * Q.block / 16]: i8x16 = i8x16.splat(0);  # half h of row r: wv[h * N + r] (unused on idotn)
    var halves[M]: i16x8 = i16x8.splat(0);  # token t's halves' sums for all N rows (Q.sub_offsets: ahalves4)
    var zq[M]: i16x8 = i16x8.splat(0);  # token t's sums of a constant zero under sub-block scales (Q.nibss: nibzeros)
    var wrow[N]: ptr = 0;
    unroll r in 0..N {
        wrow[r] = w.q + (r0 + r * rs) * nb * Q.bytes;
    }
    var arow[M]: ptr = 0;
    unroll t in 0..M {
        arow[t] = aq + (t0 + t) * nb * Q.block * ACT_BYTES;
    }
    let nbs = nb - nb % (4 * A);
    for b in 0..nbs step 4 * A {
        unroll s in 0..A {
            let blk = b + 4 * s;
            var x[M * N * 2]: i32x4 = i32x4.splat(0);  # dots 2q, 2q + 1 of block blk + j: x[4q + j]
            var wb[N]: ptr = 0;
            unroll r in 0..N {
                wb[r] = wrow[r] + blk * Q.bytes;
            }
            var ab[M]: ptr = 0;
            unroll t in 0..M {
                ab[t] = arow[t] + blk * Q.block * ACT_BYTES;
            }
            for j in 0..4 {
                var raw[M * N]: i32x4 = i32x4.splat(0);
                unroll h in 0..Q.block / 16 {
                    static if Q.nib16 * (Q.has_zero <= Q.block_zero) + Q.nibss == 0 {  # idotn(s) read the bytes
                        unroll r in 0..N {
                            wv[h * N + r] = qlanes[Q, 1](wb[r], h);
                        }
                    }
                    unroll t in 0..M {
                        static if Q.nibss * Q.const_zero * (h == 1) {  # the zero's sums, once for the N rows
                            zq[t] = nibzeros(ab[t], Q.const_zero);
                        }
                        unroll r in 0..N {
                            let i = t * N + r;
                            static if Q.pair16 * (Q.has_zero <= Q.block_zero) {  # both halves at once (qraw)
                                static if h == 1 {
                                    raw[i] = idot7p(i32x4.splat(0), wv[r], wv[N + r], ab[t], 0);
                                }
                            } else static if Q.nib16 * (Q.has_zero <= Q.block_zero) {  # from the nibbles (qraw)
                                static if h == 1 {
                                    raw[i] = idotn(i32x4.splat(0), i8x16.load(wb[r]), ab[t]);
                                }
                            } else static if Q.nibss {  # both halves under their scales, from the nibbles (qraw)
                                static if h * Q.const_zero {  # less the zero's sums (Q3_K's 4)
                                    raw[i] = idotnsz(i32x4.splat(0), i8x16.load(wb[r]), zq[t],
                                                     wb[r] + Q.sub_scales_at, ab[t]);
                                } else static if h == 1 {
                                    raw[i] = idotns(i32x4.splat(0), i8x16.load(wb[r]), wb[r] + Q.sub_scales_at, ab[t]);
                                }
                            } else static if Q.sub16 {  # both halves under their scales at once (qraw)
                                static if h == 1 {
                                    raw[i] = idotss(i32x4.splat(0), wv[r], wv[N + r], wb[r] + Q.sub_scales_at, ab[t]);
                                }
                            } else static if Q.dots2 {  # both halves' sign parts in two dot-add chains (qraw)
                                static if h == 1 {
                                    raw[i] = idots2(i32x4.splat(0), wv[r], wv[N + r], ab[t], 0);
                                }
                            } else static if h == 0 {  # the first half starts the sum: no add of zero (qraw)
                                raw[i] = qhalf[Q, 1](i32x4.splat(0), wv[r], wb[r], ab[t], h);
                            } else {
                                raw[i] = qhalf[Q, 1](raw[i], wv[h * N + r], wb[r], ab[t], h);
                            }
                        }
                    }
                }
                unroll q in 0..M * N / 2 {
                    x[4 * q] = x[4 * q + 1];
                    x[4 * q + 1] = x[4 * q + 2];
                    x[4 * q + 2] = x[4 * q + 3];
                    x[4 * q + 3] = lanepairs(raw[2 * q], raw[2 * q + 1]);
                }
                unroll r in 0..N {
                    wb[r] = wb[r] + Q.bytes;
                }
                unroll t in 0..M {
                    ab[t] = ab[t] + Q.block * ACT_BYTES;
                }
            }
            var dots[M * N]: i32x4 = i32x4.splat(0);  # dot i's four blocks, lane j: block blk + j
            unroll q in 0..M * N / 2 {
                let lo = lanequads(x[4 * q], x[4 * q + 1]);  # dots 2q, 2q + 1 of blocks 0, 1
                let hi = lanequads(x[4 * q + 2], x[4 * q + 3]);  # of blocks 2, 3
                dots[2 * q] = qexact[Q](i32x4.shuffle(lo, hi, 0, 2, 4, 6));
                dots[2 * q + 1] = qexact[Q](i32x4.shuffle(lo, hi, 1, 3, 5, 7));
            }
            unroll t in 0..M {
                let da4 = f32x4.load(ad + ((t0 + t) * nb + blk) * 4);
                let s4 = asums4[Q](as + ((t0 + t) * nb + blk) * 4);
                static if Q.sub_offsets {
                    halves[t] = ahalves4[Q](arow[t] + blk * Q.block * ACT_BYTES, s4);
                }
                unroll r in 0..N {
                    let i = t * N + r;
                    acc[i * A + s] = qscale4[Q](w, (r0 + r * rs) * nb + blk, dots[i], da4, s4, acc[i * A + s]);
                    static if Q.sub_offsets {
                        acc[i * A + s] = qmins4f[Q](w, (r0 + r * rs) * nb + blk, acc[i * A + s], halves[t], da4);
                    }
                }
            }
        }
    }
    if nbs < nb {
        unroll t in 0..M {
            let ab = aq + ((t0 + t) * nb + nbs) * Q.block * ACT_BYTES;
            let dt = ad + ((t0 + t) * nb + nbs) * 4;
            unroll r in 0..N {
                let i = (t * N + r) * A;
                acc[i] = qleft[Q](w, (r0 + r * rs) * nb + nbs, ab, dt, nb - nbs, acc[i]);
            }
        }
    }
    unroll i in 0..M * N {
        unroll s in 1..A {
            acc[i * A] = acc[i * A] + acc[i * A + s];
        }
        f32.store(y + ((t0 + i / N) * n + r0 + i % N * rs) * 4, hsum(acc[i * A]));
    }
}

# The dots of tokens t0 .. t1 - 1 with rows r0 .. r1 - 1 one at a time (qrowsum), rows outside:
# the one-dot tiling, and the token tails of tilings of one row. One call for the lot (see qrowsum).
kernel qsingles[Q: quant, A: i32](w: packed Q, aq: ptr, ad: ptr, as: ptr, y: ptr, t0: i32, t1: i32, r0: i32, r1: i32, nb: i32, n: i32) {
    for r in r0..r1 {
        for t in t0..t1 {
            f32.store(y + (t * n + r) * 4, qrowsum[Q, A](w, aq + t * nb * Q.block * ACT_BYTES, ad + t * nb * 4, as + t * nb * 4, r, nb));
        }
    }
}

# Tokens 0 .. m - 1 against the NR rows r, r + rs, ..: tiles of MR tokens, then the tokens left over
# one at a time in tiles of 1 x NR (NR = 1: qsingles). rs = 0 makes every row of a tile row r: the
# row tails of qtiles take the tile the build already holds instead of a single-dot copy of
# qrowsum per quant type (1.2-1.7 KB each), at NR times the work for those fewer than NR rows.
inline kernel qtokens[Q: quant, MR: i32, NR: i32, A: i32](w: packed Q, aq: ptr, ad: ptr, as: ptr, y: ptr, m: i32, r: i32, rs: i32, nb: i32, n: i32) {
    let tfull = m - m % MR;
    for t in 0..tfull step MR {
        qtile[Q, MR, NR, A](w, aq, ad, as, y, t, r, rs, nb, n);
    }
    static if NR == 1 {
        qsingles[Q, A](w, aq, ad, as, y, tfull, m, r, r + 1, nb, n);
    } else {
        for t in tfull..m {
            qtile[Q, 1, NR, A](w, aq, ad, as, y, t, r, rs, nb, n);
        }
    }
}

# Rows r0 .. r1 - 1 of W against tokens 0 .. m - 1: tiles of MR tokens x NR rows, the dots left
# over (token and row tails) in tiles of one token (qtokens). Row tiles outside, token tiles inside: a tile's rows
# stay in cache while every token passes over them. Each dot's order is qrowsum's whatever the
# tiling (see qtile).
# The rows are cut into NR slabs of equal length and tile i takes row i of every slab: each row of
# a tile follows, in memory, the one its position read in the tile before, so the weights are read
# as NR sequential streams that the hardware prefetchers keep up with. Tiles of adjacent rows start
# NR streams afresh per tile: qmatvec with NR = 2 ran at 0.50x NR = 1 at 8192x8192 and 0.90x at
# 4096x4096 (relaxed SIMD Q8_0, wasmtime; 0.45-0.53x with rows of 2-4 KB before int8 activations),
# with slabs 1.10x and 1.07x. Each call's range starts its streams afresh too: on the pool at
# 8192x8192, rows = 2 was 0.87x rows = 1 with chunks of 16 rows, 1.04x with 64 and 1.10x with 256.
# Slabs of at most SLAB_ROWS rows: windows of NR * SLAB_ROWS rows one after another, the rows past
# the last window in NR slabs of their own. Streams a whole range apart read from DRAM at half the
# rate of one stream on a Zen 4 EPYC: relaxed SIMD Q8_0 qmatvec at 65536x8192 (576 MB, an LM head's
# size) ran 9.1 G weights/s with rows = 2 across the range and 18.7 with windows of 64-row slabs
# (rows = 4: 9.4 and 16.5; 256-row slabs the same), unchanged at 256x4096 and on 32 matrices of
# 4096x4096 read in turn (wasmtime).
const SLAB_ROWS: i32 = 64;
kernel qtiles[Q: quant, MR: i32, NR: i32, A: i32](w: packed Q, aq: ptr, ad: ptr, y: ptr, m: i32, r0: i32, r1: i32, nb: i32, n: i32) {
    let as = act_sums(ad, m * nb);
    static if MR * NR == 1 {
        qsingles[Q, A](w, aq, ad, as, y, 0, m, r0, r1, nb, n);
    } else {
        let whole = r0 + (r1 - r0) / (NR * SLAB_ROWS) * (NR * SLAB_ROWS);  # the windows' end
        for base in r0..whole step NR * SLAB_ROWS {
            for r in base..base + SLAB_ROWS {
                qtokens[Q, MR, NR, A](w, aq, ad, as, y, m, r, SLAB_ROWS, nb, n);
            }
        }
        let slab = (r1 - whole) / NR;
        for r in whole..whole + slab {
            qtokens[Q, MR, NR, A](w, aq, ad, as, y, m, r, slab, nb, n);
        }
        for r in whole + slab * NR..r1 {  # the rows past the slabs, fewer than NR: each alone (see qtokens)
            qtokens[Q, MR, NR, A](w, aq, ad, as, y, m, r, 0, nb, n);
        }
    }
}

# ---- the grouped layout: relaxed SIMD's i7 types, Q.group rows side by side ----------------------
#
# Where a target packs a type in groups (Q.group > 1: quantformat's grouped layout, Target.layout),
# lane group j of a group's block holds values 4j .. 4j + 3 of each of its rows, row r in lanes
# 4r .. 4r + 3: one relaxed i16 dot against those four activations in every lane (alanes) leaves
# row r's products in i16 lanes 2r, 2r + 1, and pairsum turns them into i32 lane r. The rows' dots
# come out side by side, ready for their scales (also side by side: Q.rowscale): no lane folds per
# row, where rows one by one fold each block's lanes. Each row's float sum takes its blocks in order.

# Bytes 4C .. 4C + 3 of v, unsigned, in i32 lanes 0 .. 3.
inline kernel bytelanes[C: i32](v: i8x16) -> i32x4 {
    return i32x4.bits(i8x16.shuffle(v, i8x16.splat(0), 4 * C, 16, 16, 16, 4 * C + 1, 16, 16, 16, 4 * C + 2, 16, 16, 16, 4 * C + 3, 16, 16, 16));
}

# i32 lane C of v in all four lanes, as bytes: activations 4C .. 4C + 3 of a 16 for every row of a group.
inline kernel alanes[C: i32](v: i32x4) -> i8x16 {
    return i8x16.bits(i32x4.shuffle(v, v, C, C, C, C));
}

# Lane pairs C .. C + N - 1 of z (i16 pairs in i32 lanes) added, in every lane pair: from one
# relaxed dot of a constant zero with a load's 16 activations, the pairs alanes' N dots with it
# would give (lane pair r the same for every row r). N is Q.u16 of a type with a constant zero, at
# most 4: the zero sits under sub-block scales of 16 values, four lane groups of a group's rows.
inline kernel lanesums[N: i32, C: i32](z: i16x8) -> i16x8 {
    static if N == 4 {
        let h = z + i16x8.bits(i32x4.shuffle(i32x4.bits(z), i32x4.bits(z), 2, 3, 0, 1));
        return h + i16x8.bits(i32x4.shuffle(i32x4.bits(h), i32x4.bits(h), 1, 0, 3, 2));
    } else {
        var s: i16x8 = i16x8.bits(i32x4.shuffle(i32x4.bits(z), i32x4.bits(z), C, C, C, C));
        unroll c in C + 1..C + N {
            s = s + i16x8.bits(i32x4.shuffle(i32x4.bits(z), i32x4.bits(z), c, c, c, c));
        }
        return s;
    }
}

# The rows' exact dots from their code dots: the zero of a Q.block_zero type off, as zero * sum(a)
# (s: the address of the activation block's sum).
inline kernel qgexact[Q: quant](dot: i32x4, s: ptr) -> i32x4 {
    static if Q.block_zero {
        return dot - i32x4.splat(Q.zero * i32.load(s));
    } else {
        return dot;
    }
}

# The M x G group dots of tokens t0, t0 + ts, .., t0 + (M - 1) * ts with row groups g0, g0 + gs, ..,
# g0 + (G - 1) * gs of W (gs: qgtiles' slab length), row r of group g into y[t, Q.group * g + r]
# where below n. A stride of 0 repeats a token or group: the tails take the tile the build holds.
# Per block and lane group j: each group's codes unpacked once for the M tokens and each token's
# four activations spread once for the G groups (the tile's work sharing). Where the relaxed dot-add
# is one instruction (DOT_ADD, Q.adds7: types without sub-block scales or a zero of their own) idot7
# adds row r's four products straight into lane r, and a block's integer scales (Q.int_scales)
# multiply each row's lane once (vnni flavor, Chromium 156: Q4_0 1.10-1.38x, MXFP4 1.22-1.32x,
# Q4_K 1.04-1.11x the i16 pairs' qmatvec rows 2; exact, so the bits are the same). Else hdot7 adds
# their pairs in i16 lanes, Q.u16 lane groups at a time (exact: Q.u16 bounds the sums), and pairsum widens them to
# i32 (for sub-block scales, each row's in its lane pair: Q6_K's, stored as int8 pairs, eight bytes a
# half for the group, widened by the load: quantformat.SUB_SCALES). A constant zero under sub-block scales
# (Q.const_zero, Q6_K's 32) comes off before the widening as each token's pairs of the zero with its
# activations, zp, formed once for the G groups (not one more relaxed dot per group: relaxed Q6_K
# qmatvec 1.18x at 256x4096 in wasmtime) from one relaxed dot per 16 activations (lanesums; not one
# per lane group: rows 1 1.06-1.07x in wasmtime, rows 2 1.0-1.03x, bits unchanged): the codes' i16
# sums may wrap, but i16 adds are modular and the difference is within Q.u16's bound, so it is
# exact. Then per block and row, in the order of every grouped type's dots:
#   acc = madd(f32(dot - zero * sum(a)), scale * d_a, acc) (+ madd(sum(a) * d_a, offset, acc)),
# A accumulators taking the blocks in turn (block b into the one that held block b - A), added at
# the end (two at most, so their sum does not depend on which holds which). No result depends on M,
# G or the rows a thread takes: row t of qmatmul is qmatvec of token t, bit for bit.
# A super-block type whose blocks scale by F * I (Q.int_scales: Q4_K, Q5_K; F the super-block's f32,
# I a byte per block) takes them apart: I rides pairsum (pairsum(part, I): exact), F applies once
# per super-block of Q.sb_blocks blocks and row, the accumulators taking super-blocks in turn:
#   s = madd(f32(I * dot), d_a, s) over its blocks in order, from 0; acc = madd(s, F, acc).
# The offset F_o * I_o (Q4_K's -dmin * min) comes after the dots' loop, into each row's first
# accumulator: per super-block in order, m = madd(f32(I_o), sum(a) * d_a, m) over its blocks in
# order, from 0, and acc = madd(m, F_o, acc), four blocks' I a load. Both loops form each group's
# record address once per super-block (rec), which the reads of I and F take (cranelift's dots'
# loop 124 instructions a block of 8 rows, 111 so: relaxed Q4_K and Q5_K qmatvec 1.01-1.03x in
# wasmtime, bits unchanged). Relaxed qmatvec rows 2 at
# 256x4096 in wasmtime: Q4_K 1.16-1.19x, Q5_K 1.14-1.16x the per-block form above (F * I formed,
# widened and multiplied per block), where the same offset work inside the dots' loop gave 1.04x
# and within a branch at each super-block's end 0.90-1.0x (cranelift's registers and code around
# the branch). An offset over sub-blocks of 16 (Q.sub_offsets: Q2_K's -dmin * m per 16 values)
# comes after the dots' loop too, block by block in order into each row's first accumulator:
#   acc = madd(f32(m_lo * sum(a_lo) + m_hi * sum(a_hi)) * d_a, F_o, acc)
# (the low half's sum from one relaxed dot with ones, the high half's the block's sum less it, both
# paired with the rows' m by one widening dot: pairsum); relaxed Q2_K qmatvec 1.12x the same work
# inside the loop at 256x4096 (wasmtime). Each group's record address and F_o are formed once per
# record (super-block), not per block: cranelift's loop went from 95 instructions a block to 65, most
# of them the address arithmetic (qmatvec rows 2 and 4 1.04-1.05x at the best of 7 runs, wasmtime).
#   token t's activations: aq + t * nb * Q.block * ACT_BYTES, its scales ad + t * nb * 4, its
#   blocks' sums as + t * nb * 4
kernel qgtile[Q: quant, M: i32, G: i32, A: i32](w: packed Q, aq: ptr, ad: ptr, as: ptr, y: ptr, t0: i32, ts: i32, g0: i32, gs: i32, nb: i32, n: i32) {
    var acc[M * G * A]: f32x4 = f32x4.splat(0.0);
    var wg[G]: ptr = 0;  # block b of group g at wg[g] + b * Q.bytes
    unroll g in 0..G {
        wg[g] = w.q + (g0 + g * gs) * nb * Q.bytes;
    }
    var arow[M]: ptr = 0;
    unroll t in 0..M {
        arow[t] = aq + (t0 + t * ts) * nb * Q.block * ACT_BYTES;
    }
    var dot[M * G]: i32x4 = i32x4.splat(0);  # a block's dot i = t * G + g: token t with group g's rows
    var part[M * G]: i16x8 = i16x8.splat(0);  # its pairs of the lane groups since the last widening
    var u[G]: i8x16 = i8x16.splat(0);  # a lane group's codes of each group
    var zp[M]: i16x8 = i16x8.splat(0);  # a token's pairs of a constant zero (Q.const_zero) with its activations
    var ss[M * G]: f32x4 = f32x4.splat(0.0);  # Q.int_scales: s of the super-block so far
    var rec[G]: ptr = 0;  # each group's record of the super-block (Q.int_scales, Q.sub_offsets): its address once
    for b in 0..nb step Q.sb_blocks {
        static if Q.int_scales {
            unroll g in 0..G {
                rec[g] = Q.rowrecord(w, (g0 + g * gs) * nb + b);
            }
        }
        for k in b..b + Q.sb_blocks {  # a super-block's blocks; one round (k = b) for other types
            unroll j in 0..Q.units {
                unroll g in 0..G {
                    u[g] = Q.codes(wg[g] + k * Q.bytes, j);
                }
                unroll t in 0..M {
                    let v = i32x4.load(arow[t] + k * Q.block * ACT_BYTES, j / 4 * 16);
                    let av = alanes[j % 4](v);
                    static if Q.const_zero {
                        static if j % Q.u16 == 0 {
                            zp[t] = lanesums[Q.u16, j % 4](hdot7(i16x8.splat(0), Q.zeros(wg[0], j), i8x16.bits(v)));
                        }
                    }
                    unroll g in 0..G {
                        let i = t * G + g;
                        static if Q.adds7 {  # (DOT_ADD) row r's four products into lane r: idot7's dot-add
                            static if j == 0 {
                                dot[i] = idot7(i32x4.splat(0), u[g], av);
                            } else {
                                dot[i] = idot7(dot[i], u[g], av);
                            }
                        } else static if j % Q.u16 == 0 {  # the first of a widening's lane groups starts its sum
                            static if Q.own_zeros {  # a zero per row and block
                                part[i] = hdot7z(i16x8.splat(0), u[g], Q.zeros(wg[g] + k * Q.bytes, j), av);
                            } else {
                                part[i] = hdot7(i16x8.splat(0), u[g], av);
                            }
                        } else static if Q.own_zeros {
                            part[i] = hdot7z(part[i], u[g], Q.zeros(wg[g] + k * Q.bytes, j), av);
                        } else {
                            part[i] = hdot7(part[i], u[g], av);
                        }
                    }
                }
                static if Q.adds7 * Q.int_scales * (j == Q.units - 1) {  # each row's block scale I on its lane
                    unroll i in 0..M * G {
                        let pairs = i32x4.bits(Q.rowscale_pairs(w, k, rec[i % G]));  # I in both halves
                        dot[i] = dot[i] * (pairs & i32x4.splat(65535));
                    }
                }
                static if (j % Q.u16 == Q.u16 - 1) * (1 - Q.adds7) {
                    unroll i in 0..M * G {
                        var x: i32x4 = i32x4.splat(0);
                        static if Q.const_zero {
                            part[i] = part[i] - zp[i / G];
                        }
                        static if Q.has_sub_scales {  # the sub-block's integer scale of each row, in its lane pair
                            x = pairsum(part[i], i16x8.load8x8(wg[i % G] + k * Q.bytes, Q.sub_scales_at + j / 4 * 8));
                        } else static if Q.int_scales {
                            x = pairsum(part[i], Q.rowscale_pairs(w, k, rec[i % G]));
                        } else {
                            x = pairsum(part[i]);
                        }
                        static if j < Q.u16 {
                            dot[i] = x;
                        } else {
                            dot[i] = dot[i] + x;
                        }
                    }
                }
            }
            static if Q.int_scales {
                unroll t in 0..M {
                    let da = f32x4.splat(f32.load(ad + ((t0 + t * ts) * nb + k) * 4));
                    unroll g in 0..G {
                        ss[t * G + g] = madd(f32x4.convert(dot[t * G + g]), da, ss[t * G + g]);
                    }
                }
            }
        }
        static if Q.int_scales {
            unroll i in 0..M * G {
                var r: f32x4 = madd(ss[i], Q.rowscale_f(w, b, rec[i % G]), acc[i * A]);
                unroll s in 1..A {
                    acc[i * A + s - 1] = acc[i * A + s];
                }
                acc[i * A + A - 1] = r;
                ss[i] = f32x4.splat(0.0);
            }
        } else {
            unroll t in 0..M {
                let blk = (t0 + t * ts) * nb + b;
                let da = f32x4.splat(f32.load(ad + blk * 4));
                unroll g in 0..G {
                    let i = t * G + g;
                    let wb = (g0 + g * gs) * nb + b;  # the block in the planes' order: group-major
                    var r: f32x4 = madd(f32x4.convert(qgexact[Q](dot[i], as + blk * 4)), Q.rowscale(w, wb) * da, acc[i * A]);
                    static if Q.has_offset > Q.sub_offsets {
                        r = madd(f32x4.splat(f32(i32.load(as + blk * 4)) * f32.load(ad + blk * 4)), Q.rowoffset(w, wb), r);
                    }
                    unroll s in 1..A {
                        acc[i * A + s - 1] = acc[i * A + s];
                    }
                    acc[i * A + A - 1] = r;
                }
            }
        }
    }
    static if Q.sub_offsets {  # each row's offsets over sub-blocks of 16, apart from the dots' loop
        for sb in 0..nb step Q.record_blocks {  # a record's blocks (nb is whole records): its address and F once
            var fo[G]: f32x4 = f32x4.splat(0.0);
            unroll g in 0..G {
                rec[g] = Q.rowrecord(w, (g0 + g * gs) * nb + sb);
                fo[g] = Q.rowoffset(w, (g0 + g * gs) * nb + sb);
            }
            for b in sb..sb + Q.record_blocks {
                unroll t in 0..M {
                    let blk = (t0 + t * ts) * nb + b;
                    let l = ahalf[0](arow[t] + b * Q.block * ACT_BYTES);
                    let l2 = l + i32x4.shuffle(l, l, 2, 3, 0, 1);
                    let lo = l2 + i32x4.shuffle(l2, l2, 1, 0, 3, 2);  # the low half's sum in every lane
                    let hs = i16x8.bits((lo & i32x4.splat(65535)) | ((i32x4.splat(i32.load(as + blk * 4)) - lo) << 16));
                    let da = f32x4.splat(f32.load(ad + blk * 4));
                    unroll g in 0..G {
                        let i = (t * G + g) * A;
                        acc[i] = madd(f32x4.convert(pairsum(qmins[Q](rec[g], b), hs)) * da, fo[g], acc[i]);
                    }
                }
            }
        }
    }
    static if Q.int_scales * Q.has_offset {  # each row's m of every super-block, apart from the dots' loop
        for b in 0..nb step Q.sb_blocks {
            var m[M * G]: f32x4 = f32x4.splat(0.0);
            unroll g in 0..G {
                rec[g] = Q.rowrecord(w, (g0 + g * gs) * nb + b);
            }
            for q in b..b + Q.sb_blocks step 4 {  # four blocks a round
                var sa[M]: f32x4 = f32x4.splat(0.0);  # each token's sum(a) * d_a of the four blocks
                unroll t in 0..M {
                    let blk = (t0 + t * ts) * nb + q;
                    sa[t] = f32x4.convert(i32x4.load(as + blk * 4)) * f32x4.load(ad + blk * 4);
                }
                unroll g in 0..G {
                    # the four blocks' I, each of the group's rows (a byte per row and block)
                    let ints = i8x16.load(rec[g] + (q - b) * Q.group, Q.offset_ints_at);
                    unroll c in 0..4 {
                        let mf = f32x4.convert(bytelanes[c](ints));
                        unroll t in 0..M {
                            m[t * G + g] = madd(mf, f32x4.shuffle(sa[t], sa[t], c, c, c, c), m[t * G + g]);
                        }
                    }
                }
            }
            unroll i in 0..M * G {
                acc[i * A] = madd(m[i], Q.rowoffset_f(w, b, rec[i % G]), acc[i * A]);
            }
        }
    }
    unroll i in 0..M * G {
        unroll s in 1..A {
            acc[i * A] = acc[i * A] + acc[i * A + s];
        }
        let row = Q.group * (g0 + i % G * gs);
        let out = y + ((t0 + i / G * ts) * n + row) * 4;
        if row + Q.group <= n {
            f32x4.store(out, acc[i * A]);
        } else {  # the last group's rows below n, each alone (a vector store would write the next token's)
            unroll r in 0..Q.group {
                if row + r < n {
                    f32.store(out + r * 4, extract(acc[i * A], r));
                }
            }
        }
    }
}

# Tokens 0 .. m - 1 against the NR row groups g, g + gs, ..: tiles of MR tokens, then each token
# left over alone in the same tile with a token stride of 0 (its MR copies computed alike).
inline kernel qgtokens[Q: quant, MR: i32, NR: i32, A: i32](w: packed Q, aq: ptr, ad: ptr, as: ptr, y: ptr, m: i32, g: i32, gs: i32, nb: i32, n: i32) {
    let tfull = m - m % MR;
    for t in 0..tfull step MR {
        qgtile[Q, MR, NR, A](w, aq, ad, as, y, t, 1, g, gs, nb, n);
    }
    for t in tfull..m {
        qgtile[Q, MR, NR, A](w, aq, ad, as, y, t, 0, g, gs, nb, n);
    }
}

# Row groups g0 .. g1 - 1 of W against tokens 0 .. m - 1, as qtiles does rows: tiles of MR tokens x
# NR groups, the groups of a tile one slab apart (NR streams through the weights); each group past
# the slabs (fewer than NR) in the same tile with a group stride of 0. One tile per type and kernel
# in the module (the rows layout's single-dot tails cost a type 1.2-1.7 KB each), at MR or NR times
# the work of those few tokens and groups.
kernel qgtiles[Q: quant, MR: i32, NR: i32, A: i32](w: packed Q, aq: ptr, ad: ptr, y: ptr, m: i32, g0: i32, g1: i32, nb: i32, n: i32) {
    let as = act_sums(ad, m * nb);
    let slab = (g1 - g0) / NR;
    for g in g0..g0 + slab {
        qgtokens[Q, MR, NR, A](w, aq, ad, as, y, m, g, slab, nb, n);
    }
    for g in g0 + slab * NR..g1 {
        qgtokens[Q, MR, NR, A](w, aq, ad, as, y, m, g, 0, nb, n);
    }
}

# y = W a for a packed quantized matrix and quantized activations (qmatmul of one token).
#   w: packed[n, k], a packed matrix: n rows of k / Q.block blocks (in groups of Q.group rows where the target
#      packs the type so)
#   aq: i8[k * ACT_BYTES], activations from quantize_act
#   ad: f32[k / 32] then i32[k / 32], activation scales and sums from quantize_act
#   y: f32[n], written
#   n: row count
#   k: row length, a multiple of Q.stored_block (Q.block, or a super-block's 256 values)
export kernel qmatvec[Q: quant](w: packed Q, aq: ptr, ad: ptr, y: ptr, n: i32, k: i32) {
    tune rows: i32 in {1, 2, 4} = 2;  # rows (row groups in the grouped layout) per tile
    tune accs: i32 in {1, 2} = 1;
    restrict rows * accs <= 4;  # accumulators in flight: 16 vector registers on x86-64 hold no more
    parallel groups r0..r1 in 0..(n + Q.group - 1) / Q.group;  # of Q.group rows: 1, or the grouped layout's
    static if Q.group > 1 {
        qgtiles[Q, 1, rows, accs](w, aq, ad, y, 1, r0, r1, k / Q.block, n);
    } else {
        qtiles[Q, 1, rows, accs](w, aq, ad, y, 1, r0, r1, k / Q.block, n);
    }
}

# Y = A W^T for m tokens (prefill, a batch): y[t, r] = qmatvec(W, a_t)[r], bit for bit, in tiles
# of `tokens` x `rows` dots (row groups in the grouped layout). The dots' accumulators take
# qmatvec's `accs` (the summation order).
#   w: packed[n, k], a packed matrix: n rows of k / Q.block blocks (in groups of Q.group rows where the target
#      packs the type so)
#   aq: i8[m * k * ACT_BYTES], activations from quantize_act of an [m, k] array
#   ad: f32[m * k / 32] then i32[m * k / 32], activation scales and sums
#   y: f32[m, n], written
#   m: token count
#   n: row count
#   k: row length, a multiple of Q.stored_block (Q.block, or a super-block's 256 values)
export kernel qmatmul[Q: quant](w: packed Q, aq: ptr, ad: ptr, y: ptr, m: i32, n: i32, k: i32) {
    tune tokens: i32 in {1, 2, 4} = 1;  # 1 x 2: as fast as 2 x 1, and qmatvec's own tile (no more code)
    tune rows: i32 in {1, 2, 4} = 2;
    restrict tokens * rows <= 4;  # a tile's integer dots and float sums (x qmatvec's accs <= 2) in registers
    parallel groups r0..r1 in 0..(n + Q.group - 1) / Q.group;  # of W's rows, each read by one thread, every token passing over it there
    static if Q.group > 1 {
        qgtiles[Q, tokens, rows, qmatvec.accs](w, aq, ad, y, m, r0, r1, k / Q.block, n);
    } else {
        qtiles[Q, tokens, rows, qmatvec.accs](w, aq, ad, y, m, r0, r1, k / Q.block, n);
    }
}

# ---- exp, softmax, SiLU ------------------------------------------------------------------------

# Cephes-style expf constants: ln 2 split so that k * EXP_C1 is exact for the k that occur.
const LOG2E: f32 = 1.44269504088896341;
const EXP_C1: f32 = 0.693359375;
const EXP_C2: f32 = -0.000212194440;
const EXP_HI: f32 = 88.8;      # above ln(FLT_MAX): the result is +inf
const EXP_LO: f32 = -104.0;    # below ln(smallest subnormal / 2): the result is 0
const ROUND_MAGIC: f32 = 12582912.0;  # 1.5 * 2^23: adding it rounds to an integer
const EXP_P0: f32 = 0.000198756915;
const EXP_P1: f32 = 0.00139819995;
const EXP_P2: f32 = 0.00833345190;
const EXP_P3: f32 = 0.0416657959;
const EXP_P4: f32 = 0.166666655;
const EXP_P5: f32 = 0.500000012;

# exp of four f32 lanes: x = k ln2 + r with |r| <= ln2 / 2, e^r by a degree-7 polynomial, 2^k
# built in the exponent bits as 2^(k/2) * 2^(k - k/2) so that k from -150 to 128 (subnormal
# results and the last binade before overflow) needs no special case. k is rounded by adding
# 1.5 * 2^23 (the integer then sits in the low mantissa bits: no float-to-int conversion).
# NaN propagates (pmin/pmax keep a NaN first operand), +inf -> inf, -inf -> 0.
inline kernel exp4(x: f32x4) -> f32x4 {
    let xc = pmax(pmin(x, f32x4.splat(EXP_HI)), f32x4.splat(EXP_LO));
    let shifted = madd(xc, f32x4.splat(LOG2E), f32x4.splat(ROUND_MAGIC));
    let k = shifted - f32x4.splat(ROUND_MAGIC);
    let r = madd(k, f32x4.splat(-EXP_C2), madd(k, f32x4.splat(-EXP_C1), xc));
    var p: f32x4 = f32x4.splat(EXP_P0);
    p = madd(p, r, f32x4.splat(EXP_P1));
    p = madd(p, r, f32x4.splat(EXP_P2));
    p = madd(p, r, f32x4.splat(EXP_P3));
    p = madd(p, r, f32x4.splat(EXP_P4));
    p = madd(p, r, f32x4.splat(EXP_P5));
    let er = madd(p, r * r, r) + f32x4.splat(1.0);
    let ki = i32x4.bits(shifted) - i32x4.bits(f32x4.splat(ROUND_MAGIC));
    let k1 = ki >> 1;
    let s1 = f32x4.bits((k1 + 127) << 23);
    let s2 = f32x4.bits((ki - k1 + 127) << 23);
    return er * s1 * s2;
}

# A lane mask of the first `m` lanes (all four when m >= 4): where a partial last vector is valid.
inline kernel first_lanes(m: i32) -> i32x4 {
    return i32x4.iota() < i32x4.splat(m);
}

# The four f32s at p when valid >= 4, else the four ending at p + 4 valid: the last `valid` lanes
# hold the values (store_last's form). One unconditional load: nothing past the data is read (which
# may end where memory does); a partial vector's other lanes are read from before p (a value of an
# earlier group, which another thread may be writing, or below a short buffer: no address under
# HEAP_BASE is one) and never stored.
inline kernel load_last(p: ptr, valid: i32) -> f32x4 {
    return f32x4.load(p + min(valid, 4) * 4 - 16);
}

# Store the four lanes of v at p when valid >= 4, else the last `valid` (load_last's) at p .. p +
# 4 valid one by one: nothing past the data is touched (no read-modify-write of bytes another
# thread may own).
inline kernel store_last(p: ptr, v: f32x4, valid: i32) {
    if valid >= 4 {
        f32x4.store(p, v);
    } else {
        if valid == 3 {
            f32.store(p, extract(v, 1));
            f32.store(p + 4, extract(v, 2));
        }
        if valid == 2 {
            f32.store(p, extract(v, 2));
        }
        f32.store(p + valid * 4 - 4, extract(v, 3));
    }
}

# Store v at p: all four lanes when valid >= 4, else only the first `valid`, the others keeping
# what they held (softmax's rows: a row's padding up to its stride is the row's own).
inline kernel store_first(p: ptr, v: f32x4, valid: i32) {
    if valid >= 4 {
        f32x4.store(p, v);
    } else {
        f32x4.store(p, select(first_lanes(valid), v, f32x4.load(p)));
    }
}

# y = exp(x) over n f32 values.
#   x: f32[n]
#   y: f32[n], written; may be x
#   n: element count (nothing past the n values is read or written: load_last, store_last)
export kernel exp_f32(x: ptr, y: ptr, n: i32) {
    parallel groups g0..g1 in 0..(n + 3) / 4;
    exp_groups(x, y, g0, g1, n);
}

# Vector groups g0 .. g1 - 1 of exp_f32 (values 4 g0 .. 4 g1 - 1, the last group cut at n).
kernel exp_groups(x: ptr, y: ptr, g0: i32, g1: i32, n: i32) {
    for i in g0..g1 {
        store_last(y + i * 16, exp4(load_last(x + i * 16, n - i * 4)), n - i * 4);
    }
}

# Softmax of rows r0 .. r1 - 1 (see softmax_f32).
kernel softmax_rows(x: ptr, r0: i32, r1: i32, t: i32, stride: i32) {
    let full = t - t % 4;
    for r in r0..r1 {
        let row = x + r * stride * 4;
        var vmax: f32x4 = f32x4.splat(-1.0 / 0.0);
        for i in 0..full step 4 {
            vmax = pmax(f32x4.load(row + i * 4), vmax);  # may drop a NaN: exp(NaN - m) still makes the row NaN
        }
        var m: f32 = hmax(vmax);
        for i in full..t {
            m = max(m, f32.load(row + i * 4));
        }
        if m == -1.0 / 0.0 {
            m = 0.0;
        }
        let vm = f32x4.splat(m);
        var vsum: f32x4 = f32x4.splat(0.0);
        for i in 0..t step 4 {
            let e = exp4(f32x4.load(row + i * 4) - vm);
            if i + 4 <= t {
                f32x4.store(row + i * 4, e);
                vsum = vsum + e;
            } else {
                let keep = first_lanes(t - i);
                f32x4.store(row + i * 4, select(keep, e, f32x4.load(row + i * 4)));
                vsum = vsum + select(keep, e, f32x4.splat(0.0));
            }
        }
        let s = hsum(vsum);
        var inv: f32 = 0.0;
        if (s > 0.0) | (s != s) {
            inv = 1.0 / s;
        }
        let vinv = f32x4.splat(inv);
        for i in 0..t step 4 {
            store_first(row + i * 4, f32x4.load(row + i * 4) * vinv, t - i);
        }
    }
}

# Softmax of each row's first t scores, in place. Rows are `stride` floats apart, stride a multiple
# of 4 and >= t: the padding after a row's scores is where the vector code reads past the last
# score; it is written back unchanged, so the next row (perhaps another thread's) is never touched.
# A row of all -inf (fully masked) becomes all zeros; a NaN or +inf score makes its row NaN (as
# numpy's exp(x - max) / sum does). With t a multiple of 4 nothing past the scores is touched.
#   x: f32[rows, stride], softmax over x[r, 0:t] in place
#   rows: row count
#   t: valid scores per row, >= 1
#   stride: row pitch in floats, a multiple of 4, >= t
export kernel softmax_f32(x: ptr, rows: i32, t: i32, stride: i32) {
    parallel rows r0..r1 in 0..rows;
    softmax_rows(x, r0, r1, t, stride);
}

# silu(x) = x * sigmoid(x) for four lanes. sigmoid is built from e = exp(-|x|), which cannot
# overflow: 1 / (1 + e) for x >= 0, e / (1 + e) for x < 0, so silu stays accurate down to
# x = -103 (where x * e^x is still a normal float) instead of collapsing to -0 past -88.7.
inline kernel silu4(x: f32x4) -> f32x4 {
    let e = exp4(-abs(x));
    let r = f32x4.splat(1.0) / (f32x4.splat(1.0) + e);
    return x * select(x < f32x4.splat(0.0), e * r, r);
}

# Vector groups g0 .. g1 - 1 (values 4 g0 .. 4 g1 - 1, the last group cut at n) of y = silu(x),
# times g unless g is 0 (no buffer lives at address 0). A partial last group stores only its valid
# lanes (store_last).
kernel silu_groups(x: ptr, g: ptr, y: ptr, g0: i32, g1: i32, n: i32) {
    for i in g0..g1 {
        var v: f32x4 = silu4(load_last(x + i * 16, n - i * 4));
        if g != 0 {
            v = v * load_last(g + i * 16, n - i * 4);
        }
        store_last(y + i * 16, v, n - i * 4);
    }
}

# y = silu(x) * g over n values (SwiGLU's gate).
#   x: f32[n], the gate projection
#   g: f32[n], the up projection
#   y: f32[n], written; may be x or g
#   n: element count (nothing past the n values is read or written: load_last, store_last)
export kernel swiglu_f32(x: ptr, g: ptr, y: ptr, n: i32) {
    parallel groups g0..g1 in 0..(n + 3) / 4;
    silu_groups(x, g, y, g0, g1, n);
}

# y = silu(x) over n values.
#   x: f32[n]
#   y: f32[n], written; may be x
#   n: element count (nothing past the n values is read or written: load_last, store_last)
export kernel silu_f32(x: ptr, y: ptr, n: i32) {
    parallel groups g0..g1 in 0..(n + 3) / 4;
    silu_groups(x, 0, y, g0, g1, n);
}

# ---- encoder layers (BERT): erf GELU, LayerNorm, bias, mean pooling, L2 normalisation ---------
#
# Activations are f32[rows, n] row-major with n a multiple of 4 (BERT's 384 and 1536): rows are
# whole vectors, so no row shares a vector with the next and threads split by rows.

# erf on two intervals of |x| (coefficients fitted to float64 erf by least squares on Chebyshev
# nodes): |x| < ERF_SPLIT: x + x P(x^2); up to ERF_HI: 1 - Q(|x| - ERF_MID) (Q fits erfc, whose
# small size keeps 1 - Q accurate); beyond, 1 (erf(3.921875) rounds to 1 in f32).
const ERF_SPLIT: f32 = 0.921875;
const ERF_HI: f32 = 3.921875;
const ERF_MID: f32 = 2.421875;
const ERF_A0: f32 = 0.12837916612625122;
const ERF_A1: f32 = -0.3761253356933594;
const ERF_A2: f32 = 0.11282140016555786;
const ERF_A3: f32 = -0.026776403188705444;
const ERF_A4: f32 = 0.005005626007914543;
const ERF_A5: f32 = -0.0006047158385626972;
const ERF_B0: f32 = 0.0006146439700387418;
const ERF_B1: f32 = -0.0031996106263250113;
const ERF_B2: f32 = 0.007751290686428547;
const ERF_B3: f32 = -0.011446928605437279;
const ERF_B4: f32 = 0.011262149550020695;
const ERF_B5: f32 = -0.007482413202524185;
const ERF_B6: f32 = 0.003078274894505739;
const ERF_B7: f32 = -0.0003379068220965564;
const ERF_B8: f32 = -0.000506542797666043;
const ERF_B9: f32 = 0.00032916240161284804;
const ERF_B10: f32 = -3.6127876228420064e-05;
const ERF_B11: f32 = -3.377890607225709e-05;
const ERF_B12: f32 = 8.443436854577158e-06;
const ERF_B13: f32 = 6.698870720356354e-07;
const SQRT1_2: f32 = 0.70710678118654752;

# erf of four f32 lanes (tests/test_encoder.py measures the ulp). Both polynomials run on every
# lane and a select picks one; the sign is copied from x, so erf(-0) = -0 and NaN stays NaN.
inline kernel erf4(x: f32x4) -> f32x4 {
    let a = abs(x);
    let t = a * a;
    var p: f32x4 = f32x4.splat(ERF_A5);
    p = madd(p, t, f32x4.splat(ERF_A4));
    p = madd(p, t, f32x4.splat(ERF_A3));
    p = madd(p, t, f32x4.splat(ERF_A2));
    p = madd(p, t, f32x4.splat(ERF_A1));
    p = madd(p, t, f32x4.splat(ERF_A0));
    let small = madd(a, p, a);
    let u = min(a, f32x4.splat(ERF_HI)) - f32x4.splat(ERF_MID);  # min keeps a NaN
    var q: f32x4 = f32x4.splat(ERF_B13);
    q = madd(q, u, f32x4.splat(ERF_B12));
    q = madd(q, u, f32x4.splat(ERF_B11));
    q = madd(q, u, f32x4.splat(ERF_B10));
    q = madd(q, u, f32x4.splat(ERF_B9));
    q = madd(q, u, f32x4.splat(ERF_B8));
    q = madd(q, u, f32x4.splat(ERF_B7));
    q = madd(q, u, f32x4.splat(ERF_B6));
    q = madd(q, u, f32x4.splat(ERF_B5));
    q = madd(q, u, f32x4.splat(ERF_B4));
    q = madd(q, u, f32x4.splat(ERF_B3));
    q = madd(q, u, f32x4.splat(ERF_B2));
    q = madd(q, u, f32x4.splat(ERF_B1));
    q = madd(q, u, f32x4.splat(ERF_B0));
    var r: f32x4 = select(a < f32x4.splat(ERF_SPLIT), small, f32x4.splat(1.0) - q);
    r = select(a >= f32x4.splat(ERF_HI), f32x4.splat(1.0), r);
    let sign = i32x4.bits(x) ^ i32x4.bits(a);
    return f32x4.bits(i32x4.bits(r) | sign);
}

# Vector groups g0 .. g1 - 1 of erf_f32 (values 4 g0 .. 4 g1 - 1, the last group cut at n).
kernel erf_groups(x: ptr, y: ptr, g0: i32, g1: i32, n: i32) {
    for i in g0..g1 {
        store_last(y + i * 16, erf4(load_last(x + i * 16, n - i * 4)), n - i * 4);
    }
}

# y = erf(x) over n f32 values.
#   x: f32[n]
#   y: f32[n], written; may be x
#   n: element count (nothing past the n values is read or written: load_last, store_last)
export kernel erf_f32(x: ptr, y: ptr, n: i32) {
    erf_groups(x, y, 0, (n + 3) / 4, n);
}

# Rows r0 .. r1 - 1 of gelu_f32: gelu(v) = v / 2 (1 + erf(v / sqrt 2)), v = x + b.
kernel gelu_rows(x: ptr, b: ptr, y: ptr, r0: i32, r1: i32, n: i32) {
    let half = f32x4.splat(0.5);
    for r in r0..r1 {
        let row = r * n * 4;
        for i in 0..n step 4 {
            let v = f32x4.load(x + row + i * 4) + f32x4.load(b + i * 4);
            let hv = v * half;
            f32x4.store(y + row + i * 4, madd(hv, erf4(v * f32x4.splat(SQRT1_2)), hv));
        }
    }
}

# BERT's GELU in its erf form, with the bias of the linear layer before it fused in:
# y[r, j] = gelu(x[r, j] + b[j]).
#   x: f32[rows, n]
#   b: f32[n], the bias (zeros for none)
#   y: f32[rows, n], written; may be x
#   rows: row count
#   n: row length, a multiple of 4
export kernel gelu_f32(x: ptr, b: ptr, y: ptr, rows: i32, n: i32) {
    parallel rows r0..r1 in 0..rows;
    gelu_rows(x, b, y, r0, r1, n);
}

# y[r, j] = x[r, j] + b[j]: a linear layer's bias.
#   x: f32[rows, n]
#   b: f32[n]
#   y: f32[rows, n], written; may be x
#   rows: row count
#   n: row length, a multiple of 4
export kernel add_bias_f32(x: ptr, b: ptr, y: ptr, rows: i32, n: i32) {
    for r in 0..rows {
        let row = r * n * 4;
        for i in 0..n step 4 {
            f32x4.store(y + row + i * 4, f32x4.load(x + row + i * 4) + f32x4.load(b + i * 4));
        }
    }
}

# Rows r0 .. r1 - 1 of layernorm_f32, three passes over each row: v = x + res + b (stored in y)
# and its sum; the sum of squared deviations from the mean; the normalised row.
kernel layernorm_rows(x: ptr, res: ptr, b: ptr, gamma: ptr, beta: ptr, y: ptr, r0: i32, r1: i32, n: i32, eps: f32) {
    let inv_n = 1.0 / f32(n);
    for r in r0..r1 {
        let row = r * n * 4;
        var acc: f32x4 = f32x4.splat(0.0);
        for i in 0..n step 4 {
            let v = (f32x4.load(x + row + i * 4) + f32x4.load(res + row + i * 4)) + f32x4.load(b + i * 4);
            f32x4.store(y + row + i * 4, v);
            acc = acc + v;
        }
        let mean = f32x4.splat(hsum(acc) * inv_n);
        var sq: f32x4 = f32x4.splat(0.0);
        for i in 0..n step 4 {
            let d = f32x4.load(y + row + i * 4) - mean;
            sq = madd(d, d, sq);
        }
        let inv_sd = f32x4.splat(1.0 / sqrt(hsum(sq) * inv_n + eps));
        for i in 0..n step 4 {
            let d = (f32x4.load(y + row + i * 4) - mean) * inv_sd;
            f32x4.store(y + row + i * 4, madd(d, f32x4.load(gamma + i * 4), f32x4.load(beta + i * 4)));
        }
    }
}

# LayerNorm over each row of v = x + res + b (BERT adds the residual and the bias of the linear
# layer before it): y = (v - mean) / sqrt(var + eps) * gamma + beta, mean and variance (biased) of
# the row, the variance from the deviations (two passes).
#   x: f32[rows, n]
#   res: f32[rows, n], the residual
#   b: f32[n], a bias
#   gamma: f32[n]
#   beta: f32[n]
#   y: f32[rows, n], written; may be x or res
#   rows: row count
#   n: row length, a multiple of 4
#   eps: added to the variance (BERT: 1e-12)
export kernel layernorm_f32(x: ptr, res: ptr, b: ptr, gamma: ptr, beta: ptr, y: ptr, rows: i32, n: i32, eps: f32) {
    parallel rows r0..r1 in 0..rows;
    layernorm_rows(x, res, b, gamma, beta, y, r0, r1, n, eps);
}

# Mean of each sequence's tokens under its mask: y[s] = sum_i mask[s, i] x[s, i] / sum_i mask[s, i]
# (the sum of the mask clamped to >= 1e-9, as sentence-transformers does). Tokens whose mask is 0
# are skipped, so padding never reaches the result whatever it holds (NaN included).
#   x: f32[seqs, t, n], token vectors
#   mask: f32[seqs, t], 1 for real tokens, 0 for padding (other weights are used as given)
#   y: f32[seqs, n], written
#   seqs: sequence count
#   t: tokens per sequence (padded length)
#   n: vector length, a multiple of 4
export kernel mean_pool_f32(x: ptr, mask: ptr, y: ptr, seqs: i32, t: i32, n: i32) {
    for s in 0..seqs {
        let out = y + s * n * 4;
        for j in 0..n step 4 {
            f32x4.store(out + j * 4, f32x4.splat(0.0));
        }
        var total: f32 = 0.0;
        for i in 0..t {
            let w = f32.load(mask + (s * t + i) * 4);
            if w != 0.0 {
                total = total + w;
                let tok = x + (s * t + i) * n * 4;
                let vw = f32x4.splat(w);
                for j in 0..n step 4 {
                    f32x4.store(out + j * 4, madd(f32x4.load(tok + j * 4), vw, f32x4.load(out + j * 4)));
                }
            }
        }
        let inv = f32x4.splat(1.0 / max(total, 1e-9));
        for j in 0..n step 4 {
            f32x4.store(out + j * 4, f32x4.load(out + j * 4) * inv);
        }
    }
}

# Each row scaled to unit length, y = x / |x|. The row is divided by max|x| first so that its
# squares neither overflow nor underflow; a zero row stays zero; a row holding inf or NaN becomes NaN.
#   x: f32[rows, n]
#   y: f32[rows, n], written; may be x
#   rows: row count
#   n: row length, a multiple of 4
export kernel l2_normalize_f32(x: ptr, y: ptr, rows: i32, n: i32) {
    for r in 0..rows {
        let row = r * n * 4;
        var m: f32x4 = f32x4.splat(0.0);
        for i in 0..n step 4 {
            m = max(m, abs(f32x4.load(x + row + i * 4)));
        }
        var big: f32 = hmax(m);
        var inv_norm: f32 = 0.0;  # stays 0 for a zero row
        if big == 0.0 {
            big = 1.0;  # no 0 / 0 below
        }
        let vbig = f32x4.splat(big);
        var sq: f32x4 = f32x4.splat(0.0);
        for i in 0..n step 4 {
            let v = f32x4.load(x + row + i * 4) / vbig;
            sq = madd(v, v, sq);
        }
        let norm = sqrt(hsum(sq));
        if norm != 0.0 {
            inv_norm = 1.0 / norm;
        }
        let vs = f32x4.splat(inv_norm);
        for i in 0..n step 4 {
            f32x4.store(y + row + i * 4, (f32x4.load(x + row + i * 4) / vbig) * vs);
        }
    }
}

# ---- attention (BERT): per sentence and head, on the QKV projection's rows as they are ----------
#
# qkv holds every sentence's tokens one after another, row i = q | k | v of heads * d values each
# (queries already scaled by 1 / sqrt(d)); sentence s owns rows starts[s] .. starts[s + 1] - 1.
# A query sees only its own sentence's keys: that range is the padding mask, so no padded token is
# ever computed or read. One job item is one (sentence, head); it owns one scratch row of scores.

# Scores of query row `q` against keys t0 .. t1 - 1 of one head into row[0 .. t1 - t0): each a dot
# of d values in ftile_nt's order (lane j sums the products c = j mod 4 in order, then hsum), four
# keys per pass so that their chains overlap. Multiply, then add, as the f32 matrix products do
# (wasmtime's fused relaxed madd overwrites a factor: the shared query vector would be copied).
kernel attention_scores(q: ptr, k: ptr, row: ptr, t0: i32, t1: i32, ld: i32, d: i32) {
    let full = t1 - (t1 - t0) % 4;
    for j in t0..full step 4 {
        var acc[4]: f32x4 = f32x4.splat(0.0);
        for c in 0..d step 4 {
            let qv = f32x4.load(q + c * 4);
            unroll u in 0..4 {
                acc[u] = acc[u] + qv * f32x4.load(k + ((j + u) * ld + c) * 4);
            }
        }
        f32x4.store(row + (j - t0) * 4, hsum(acc[0], acc[1], acc[2], acc[3]));
    }
    for j in full..t1 {
        var acc: f32x4 = f32x4.splat(0.0);
        for c in 0..d step 4 {
            acc = acc + f32x4.load(q + c * 4) * f32x4.load(k + (j * ld + c) * 4);
        }
        f32.store(row + (j - t0) * 4, hsum(acc));
    }
}

# y[0 .. d) = sum over keys j of p[j - t0] v[j]: sixteen columns per pass (four vector chains),
# each output summing its products in key order (ftile_nn's order).
kernel attention_values(p: ptr, v: ptr, y: ptr, t0: i32, t1: i32, ld: i32, d: i32) {
    for c in 0..d step 16 {
        var acc[4]: f32x4 = f32x4.splat(0.0);
        for j in t0..t1 {
            let pj = f32x4.splat(f32.load(p + (j - t0) * 4));
            unroll u in 0..4 {
                acc[u] = acc[u] + pj * f32x4.load(v + (j * ld + c) * 4, u * 16);
            }
        }
        unroll u in 0..4 {
            f32x4.store(y + c * 4, u * 16, acc[u]);
        }
    }
}

# Items j0 .. j1 - 1 of attention_f32, item j = (sentence j / heads, head j % heads).
kernel attention_items(qkv: ptr, starts: ptr, scratch: ptr, y: ptr, j0: i32, j1: i32, heads: i32, d: i32, stride: i32) {
    let n = heads * d;
    let ld = 3 * n;
    for j in j0..j1 {
        let s = j / heads;
        let h = j % heads;
        let t0 = i32.load(starts + s * 4);
        let t1 = i32.load(starts + s * 4 + 4);
        if (t1 < t0) | (t1 - t0 > stride) {  # out of order, or longer than a scratch row: it would write the next
            trap();
        }
        let row = scratch + j * stride * 4;
        let keys = qkv + (n + h * d) * 4;
        let values = qkv + (2 * n + h * d) * 4;
        for i in t0..t1 {
            attention_scores(qkv + (i * ld + h * d) * 4, keys, row, t0, t1, ld, d);
            softmax_rows(row, 0, 1, t1 - t0, stride);
            attention_values(row, values, y + (i * n + h * d) * 4, t0, t1, ld, d);
        }
    }
}

# Multi-head self-attention of a batch of sentences: for each sentence, head and query token,
# y = softmax(q . k_j over the sentence's keys j) weighted sum of v_j. Rounding: each score as
# matmul_f32_nt (|error| <= (d / 4 + 2) 2^-24 sum |q_c k_c|), the softmax as softmax_f32, each
# output as matmul_f32_nn over the sentence's length L ((L + 1) 2^-24 sum |p_j v_j|).
#   qkv: f32[starts[seqs], 3 * heads * d], row = q | k | v, queries scaled by 1 / sqrt(d)
#   starts: i32[seqs + 1], sentence s owns rows starts[s] .. starts[s + 1] - 1 (at least one),
#           starts[0] = 0, starts[seqs] = rows
#   scratch: f32[seqs * heads, stride], overwritten
#   y: f32[starts[seqs], heads * d], written
#   seqs: sentence count
#   heads: heads per token
#   d: head size, a multiple of 16
#   stride: scratch row length, a multiple of 4, at least the longest sentence (a longer one traps)
export kernel attention_f32(qkv: ptr, starts: ptr, scratch: ptr, y: ptr, seqs: i32, heads: i32, d: i32, stride: i32) {
    parallel items j0..j1 in 0..seqs * heads;
    attention_items(qkv, starts, scratch, y, j0, j1, heads, d, stride);
}

# ---- f64 sin, cos, exp, log (wasm has none) and RoPE -------------------------------------------

# pi/2 in three parts of 33, 33 and 53 bits: n * PIO2_1 and n * PIO2_2 are exact for |n| < 2^20,
# so x - n pi/2 keeps its accuracy for |x| up to about 1.6e6 (RoPE angles reach 8192).
const INV_PIO2: f64 = 0.636619772367581382433;
const PIO2_1: f64 = 1.57079632673412561417;
const PIO2_2: f64 = 0.0000000000607710050630396597660;
const PIO2_3: f64 = 0.00000000000000000000202226624879595063154;
# Minimax polynomials for sin and cos on [-pi/4, pi/4].
const SIN_1: f64 = -0.166666666666666324348;
const SIN_2: f64 = 0.00833333333332248946124;
const SIN_3: f64 = -0.000198412698298579493134;
const SIN_4: f64 = 0.00000275573137070700676789;
const SIN_5: f64 = -0.0000000250507602534068634195;
const SIN_6: f64 = 0.000000000158969099521155010221;
const COS_1: f64 = 0.0416666666666666019037;
const COS_2: f64 = -0.00138888888888741095749;
const COS_3: f64 = 0.0000248015872894767294178;
const COS_4: f64 = -0.000000275573143513906633035;
const COS_5: f64 = 0.00000000208757232129817482790;
const COS_6: f64 = -0.0000000000113596475577881948265;

# sin(r + rl) for |r| <= pi/4, rl a correction far below r's last bit.
inline kernel sin_kernel(r: f64, rl: f64) -> f64 {
    let z = r * r;
    let p = SIN_2 + z * (SIN_3 + z * (SIN_4 + z * (SIN_5 + z * SIN_6)));
    let v = z * r;
    return r - ((z * (0.5 * rl - v * p) - rl) - v * SIN_1);
}

# cos(r + rl) for |r| <= pi/4.
inline kernel cos_kernel(r: f64, rl: f64) -> f64 {
    let z = r * r;
    let p = z * (COS_1 + z * (COS_2 + z * (COS_3 + z * (COS_4 + z * (COS_5 + z * COS_6)))));
    let hz = 0.5 * z;
    let w = 1.0 - hz;
    return w + (((1.0 - w) - hz) + (z * p - r * rl));
}

# sin (want_cos = 0) or cos (1) of x: x = n pi/2 + (r + rl) by three-part Cody-Waite reduction,
# then the kernel of the quadrant (n + want_cos) mod 4.
kernel sincos64[WANT_COS: i32](x: f64) -> f64 {
    let n = nearest(x * INV_PIO2);
    let r1 = x - n * PIO2_1;
    let w = n * PIO2_2;
    let r2 = r1 - w;
    let rl = ((r1 - r2) - w) - n * PIO2_3;
    let r = r2 + rl;
    let lo = (r2 - r) + rl;
    let quadrant = (i32(i64(n)) + WANT_COS) & 3;
    var y: f64 = 0.0;
    if quadrant & 1 == 0 {
        y = sin_kernel(r, lo);
    } else {
        y = cos_kernel(r, lo);
    }
    if quadrant >= 2 {
        y = -y;
    }
    static if WANT_COS == 0 {
        if x == 0.0 {
            y = x;  # sin(-0) is -0
        }
    }
    return y;
}

const LN2_HI: f64 = 0.693147180369123816490;
const LN2_LO: f64 = 0.000000000190821492927058770002;
const INV_LN2: f64 = 1.44269504088896338700;
const EXP64_1: f64 = 0.166666666666666019037;
const EXP64_2: f64 = -0.00277777777770155933842;
const EXP64_3: f64 = 0.0000661375632143793436117;
const EXP64_4: f64 = -0.00000165339022054652515390;
const EXP64_5: f64 = 0.0000000413813679705723846039;

# exp(x) in f64: x = k ln2 + r, e^r by a rational approximation, 2^k in two halves (as exp4).
kernel exp64(x: f64) -> f64 {
    let xc = max(min(x, 709.9), -746.0);
    let k = nearest(xc * INV_LN2);
    let hi = xc - k * LN2_HI;
    let lo = k * LN2_LO;
    let r = hi - lo;
    let t = r * r;
    let c = r - t * (EXP64_1 + t * (EXP64_2 + t * (EXP64_3 + t * (EXP64_4 + t * EXP64_5))));
    let y = 1.0 - ((lo - (r * c) / (2.0 - c)) - hi);
    let ki = i64(k);
    let k1 = ki >> 1;
    return y * f64.bits((k1 + 1023) << 52) * f64.bits((ki - k1 + 1023) << 52);
}

const LOG_1: f64 = 0.6666666666666735130;
const LOG_2: f64 = 0.3999999999940941908;
const LOG_3: f64 = 0.2857142874366239149;
const LOG_4: f64 = 0.2222219843214978396;
const LOG_5: f64 = 0.1818357216161805012;
const LOG_6: f64 = 0.1531383769920937332;
const LOG_7: f64 = 0.1479819860511658591;

# log(x) in f64: x = 2^k (1 + f) with 1 + f in [sqrt(2)/2, sqrt(2)), log(1 + f) from s = f / (2 + f)
# and a polynomial in s^2. Subnormals are scaled up first; x < 0 or NaN -> NaN, 0 -> -inf, inf -> inf.
kernel log64(x: f64) -> f64 {
    var v: f64 = x;
    var k: i64 = 0;
    if v < 2.2250738585072014e-308 {
        v = v * 18014398509481984.0;
        k = -54;
    }
    let bits = i64.bits(v);
    k = k + ((bits >> 52) & 2047) - 1023;
    var m: f64 = f64.bits((bits & 4503599627370495) | 4607182418800017408);
    if m > 1.4142135623730951 {
        m = m * 0.5;
        k = k + 1;
    }
    let f = m - 1.0;
    let s = f / (2.0 + f);
    let z = s * s;
    let w = z * z;
    let t1 = w * (LOG_2 + w * (LOG_4 + w * LOG_6));
    let t2 = z * (LOG_1 + w * (LOG_3 + w * (LOG_5 + w * LOG_7)));
    let hfsq = 0.5 * f * f;
    let kf = f64(k);
    var y: f64 = kf * LN2_HI - ((hfsq - (s * (hfsq + t1 + t2) + kf * LN2_LO)) - f);
    if x == 0.0 {
        y = -1.0 / 0.0;
    }
    if (x < 0.0) | (x != x) {
        y = 0.0 / 0.0;
    }
    if x == 1.0 / 0.0 {
        y = x;
    }
    return y;
}

# y[i] = sin(x[i]) over n f64 values.
#   x: f64[n]
#   y: f64[n], written
#   n: element count
export kernel sin_f64(x: ptr, y: ptr, n: i32) {
    for i in 0..n {
        f64.store(y + i * 8, sincos64[0](f64.load(x + i * 8)));
    }
}

# y[i] = cos(x[i]) over n f64 values.
#   x: f64[n]
#   y: f64[n], written
#   n: element count
export kernel cos_f64(x: ptr, y: ptr, n: i32) {
    for i in 0..n {
        f64.store(y + i * 8, sincos64[1](f64.load(x + i * 8)));
    }
}

# y[i] = exp(x[i]) over n f64 values.
#   x: f64[n]
#   y: f64[n], written
#   n: element count
export kernel exp_f64(x: ptr, y: ptr, n: i32) {
    for i in 0..n {
        f64.store(y + i * 8, exp64(f64.load(x + i * 8)));
    }
}

# y[i] = log(x[i]) over n f64 values.
#   x: f64[n]
#   y: f64[n], written
#   n: element count
export kernel log_f64(x: ptr, y: ptr, n: i32) {
    for i in 0..n {
        f64.store(y + i * 8, log64(f64.load(x + i * 8)));
    }
}

# RoPE tables: for positions pos0 .. pos0 + npos - 1 and pairs i < dim / 2, the angle
# (pos0 + p) * theta^(-2i / dim), computed in f64, its cos and sin stored as f32.
#   cos: f32[npos, dim / 2], written
#   sin: f32[npos, dim / 2], written
#   pos0: first position
#   npos: position count
#   dim: head dimension, a multiple of 2
#   theta: the RoPE base, e.g. 10000 or 1e6
export kernel rope_table(cos: ptr, sin: ptr, pos0: i32, npos: i32, dim: i32, theta: f64) {
    let half = dim / 2;
    let lt = log64(theta);
    for i in 0..half {
        let freq = exp64(-(f64(2 * i) / f64(dim)) * lt);
        for p in 0..npos {
            let angle = f64(pos0 + p) * freq;
            let at = (p * half + i) * 4;
            f32.store(cos + at, f32(sincos64[1](angle)));
            f32.store(sin + at, f32(sincos64[0](angle)));
        }
    }
}

# Rotate heads h0 .. h1 - 1 (see rope_halves_f32 and rope_pairs_f32).
kernel rope_heads[PAIRS: i32](x: ptr, cos: ptr, sin: ptr, h0: i32, h1: i32, dim: i32) {
    static if PAIRS {
        for h in h0..h1 {
            let a = x + h * dim * 4;
            for i in 0..dim / 2 step 4 {
                let c = f32x4.load(cos + i * 4);
                let s = f32x4.load(sin + i * 4);
                let u = f32x4.load(a + i * 8);
                let v = f32x4.load(a + i * 8, 16);
                let even = f32x4.shuffle(u, v, 0, 2, 4, 6);
                let odd = f32x4.shuffle(u, v, 1, 3, 5, 7);
                let e = even * c - odd * s;
                let o = even * s + odd * c;
                f32x4.store(a + i * 8, f32x4.shuffle(e, o, 0, 4, 1, 5));
                f32x4.store(a + i * 8, 16, f32x4.shuffle(e, o, 2, 6, 3, 7));
            }
        }
    } else {
        let half = dim / 2;
        for h in h0..h1 {
            let a = x + h * dim * 4;
            let b = a + half * 4;
            for i in 0..half step 4 {
                let c = f32x4.load(cos + i * 4);
                let s = f32x4.load(sin + i * 4);
                let x0 = f32x4.load(a + i * 4);
                let x1 = f32x4.load(b + i * 4);
                f32x4.store(a + i * 4, x0 * c - x1 * s);
                f32x4.store(b + i * 4, x0 * s + x1 * c);
            }
        }
    }
}

# Rotate heads in place, pairs (x[i], x[i + dim/2]) (the half-split convention of GPT-NeoX and
# Hugging Face Llama) by the table row of one position.
#   x: f32[heads, dim], rotated in place
#   cos: f32[dim / 2], the position's row of rope_table's cos
#   sin: f32[dim / 2], its row of sin
#   heads: head count
#   dim: head dimension, a multiple of 8
export kernel rope_halves_f32(x: ptr, cos: ptr, sin: ptr, heads: i32, dim: i32) {
    parallel heads h0..h1 in 0..heads;
    rope_heads[0](x, cos, sin, h0, h1, dim);
}

# Rotate heads in place, adjacent pairs (x[2i], x[2i + 1]) (the interleaved convention of the
# original RoPE and GPT-J), by the table row of one position.
#   x: f32[heads, dim], rotated in place
#   cos: f32[dim / 2], the position's row of rope_table's cos
#   sin: f32[dim / 2], its row of sin
#   heads: head count
#   dim: head dimension, a multiple of 8
export kernel rope_pairs_f32(x: ptr, cos: ptr, sin: ptr, heads: i32, dim: i32) {
    parallel heads h0..h1 in 0..heads;
    rope_heads[1](x, cos, sin, h0, h1, dim);
}

# ---- the thread pool ---------------------------------------------------------------------------
#
# One thread, the driver, calls par_for; every other thread runs pool_helper on its own instance
# over the same memory and stays in it until POOL_STOP is set. The words are at fixed addresses
# (kernelgen/compiler/layout.py, manifest "memory.fixed"). POOL_GEN holds the job generation in its upper
# 24 bits and the number of helpers taking part in its low 8, so a helper reads both at once: a
# helper that wakes late can never mistake one job's helper count for another's.

# Rounds a thread spins before it sleeps in wait32. A round is a few nanoseconds, so this is tens of
# microseconds: longer than a futex wake-up, so that back-to-back jobs never put a thread to sleep
# (at 4000 rounds both threads slept in every job on a 2024 EPYC: 6-60 us per empty job, against
# 1.2 us at 40000 on the same machine), and short enough that an idle pool soon stops burning a core.
const SPIN_ROUNDS: i32 = 40000;
const WAIT_NS: i64 = 1000000;      # the driver re-checks POOL_LEFT at least every millisecond

# Claim chunks of the current job with an atomic add on POOL_NEXT and run them.
kernel pool_work() {
    let job = atomic_load(POOL_JOB);
    let count = atomic_load(POOL_COUNT);
    let chunk = atomic_load(POOL_CHUNK);
    var begin: i32 = atomic_add(POOL_NEXT, chunk);
    while begin < count {
        run_job(job, begin, min(begin + chunk, count));
        begin = atomic_add(POOL_NEXT, chunk);
    }
}

# Count one helper out of the current job; the last one out wakes the driver. The host calls it
# for a helper whose job trapped, so the driver is never left waiting.
export kernel pool_done() {
    if atomic_sub(POOL_LEFT, 1) == 1 {
        notify(POOL_LEFT, 1);
    }
}

# A helper thread's loop: spin, then sleep, until the generation changes; take part when its id is
# below the generation's helper count. Returns only once POOL_STOP is set.
#   id: this helper's number, 0 .. threads - 2
#   rejoin: 0 the first time (counts the helper into POOL_READY), 1 when re-entered after a trap
#   last: when rejoining, the POOL_GEN of the job that trapped: a job published since then is new
export kernel pool_helper(id: i32, rejoin: i32, last: i32) {
    var seen: i32 = last;
    if rejoin == 0 {
        seen = atomic_load(POOL_GEN);
        atomic_add(POOL_READY, 1);
    }
    var spin: i32 = 0;
    while atomic_load(POOL_STOP) == 0 {
        let gen = atomic_load(POOL_GEN);
        if gen == seen {
            spin = spin + 1;
            if spin > SPIN_ROUNDS {
                wait32(POOL_GEN, seen, -1);
            }
        } else {
            seen = gen;
            spin = 0;
            if id < (gen & 255) {
                pool_work();
                pool_done();
            }
        }
    }
}

# Wait until every helper of the current job has counted itself out: spin first (a helper that is
# already spinning finishes a small job in about a microsecond, far less than a futex wake-up),
# then sleep in wait32.
export kernel pool_wait() {
    var left: i32 = atomic_load(POOL_LEFT);
    var spin: i32 = 0;
    while left != 0 {
        if spin < SPIN_ROUNDS {
            spin = spin + 1;
        } else {
            wait32(POOL_LEFT, left, WAIT_NS);
        }
        left = atomic_load(POOL_LEFT);
    }
}

# Run job `job` (its index in the job table, manifest "jobs") on items 0 .. count - 1 in chunks,
# on this thread and min(POOL_READY, POOL_WANT) helpers; returns when all items are done. The
# job's arguments are in JOB_ARGS. Only the driver calls it, one job at a time.
#   job: job table index
#   count: item count
#   chunk: items per claim, >= 1
export kernel par_for(job: i32, count: i32, chunk: i32) {
    let nhelp = min(min(atomic_load(POOL_READY), atomic_load(POOL_WANT)), 255);
    atomic_store(POOL_JOB, job);
    atomic_store(POOL_COUNT, count);
    atomic_store(POOL_CHUNK, chunk);
    atomic_store(POOL_NEXT, 0);
    atomic_store(POOL_LEFT, nhelp);
    atomic_store(POOL_GEN, (((atomic_load(POOL_GEN) >> 8) + 1) << 8) | nhelp);
    if nhelp > 0 {
        notify(POOL_GEN, -1);
    }
    pool_work();
    pool_wait();
}

# Ask every helper to leave pool_helper (the host joins their threads afterwards).
export kernel pool_stop() {
    atomic_store(POOL_STOP, 1);
    atomic_store(POOL_GEN, atomic_load(POOL_GEN) + 256);
    notify(POOL_GEN, -1);
}
