// Packing stored quant blocks into the planes the kernels read, from the manifest alone.
//
// Mirrors QuantFormat.pack in kernelgen/quantformat.py: the manifest's "quants" entry of a type gives its
// fields, value fields, interleaved fields and its formulas as JSON trees, so any declared type
// packs here without code of its own. Planes (each contiguous, row-major, one entry per block):
//   q       the value fields' bytes, concatenated in "value_fields" order ("interleaved" nibble
//           fields repacked from ONNX order, element 2i low / 2i+1 high, to split order)
//   scale   f32: the "scale" formula (f16 fields widened); for a type with a "record" (super-blocks
//           whose scale and offset are F * I), one record of "record.bytes" per stored block: each
//           factor's F as f32 at f_at, its I as a byte per kernel block from i_at ("per" bytes: an
//           offset over sub-blocks of 16 keeps each sub-block's)
//   offset  f32: the "offset" formula, only for flat types that have one
// A type whose "group" is more than 1 (the grouped layout: quantformat.py's docstring) has its rows
// padded with zero blocks to whole groups and each group's rows interleaved granule by granule, as
// each plane's "granules" say (the f32s and codes GRANULE bytes at a time, a record's integers a
// byte at a time, integer sub-block scales an int8 pair at a time); a scalar byte value field takes
// a granule, its byte four times.

import { I32_MAX } from './manifest.mjs';

const INT8_MIN = -128; // unpacked weights must fit the kernels' int8 lanes (QuantFormat.pack checks the same)
const INT8_MAX = 127;
const FIELD_BYTES = { i8: 1, u8: 1, i16: 2, u16: 2, f16: 2, i32: 4, u32: 4, f32: 4 };
const FIELD_READERS = {
  i8: (v, o) => v.getInt8(o),
  u8: (v, o) => v.getUint8(o),
  i16: (v, o) => v.getInt16(o, true),
  u16: (v, o) => v.getUint16(o, true),
  f16: (v, o) => halfToFloat(v.getUint16(o, true)),
  i32: (v, o) => v.getInt32(o, true),
  u32: (v, o) => v.getUint32(o, true),
  f32: (v, o) => v.getFloat32(o, true),
};

const PLANE_ARRAYS = { '|u1': Uint8Array, '<f4': Float32Array, '<i4': Int32Array };
const GRANULE = 4; // bytes of a row side by side with its group's other rows (quantformat.GRANULE)
const SUB_SCALE_GRANULE = 2; // bytes of an int8 sub-block scale in the grouped layout, stored twice (quantformat.SUB_SCALE_GRANULE)

// A typed array's own length, byte length and class, which an object cannot override (an own
// `length` or `constructor` property would have the copies read or write the wrong memory).
const TYPED_ARRAY = Object.getPrototypeOf(Int8Array.prototype);
export const lengthOf = Object.getOwnPropertyDescriptor(TYPED_ARRAY, 'length').get;
export const byteLengthOf = Object.getOwnPropertyDescriptor(TYPED_ARRAY, 'byteLength').get;
const typedArrayName = Object.getOwnPropertyDescriptor(TYPED_ARRAY, Symbol.toStringTag).get; // undefined for others
const TYPED_CLASSES = Object.assign(Object.create(null), Object.fromEntries([Float32Array, Float64Array, Int8Array, Uint8Array,
  Uint8ClampedArray, Int16Array, Uint16Array, Int32Array, Uint32Array, BigInt64Array, BigUint64Array].map((C) => [C.name, C])));
/** A typed array's class (by its internal name: 25x faster than trying instanceof in turn, and a
 * kernel call copies three arrays), else undefined. */
export const classOf = (a) => TYPED_CLASSES[typedArrayName.call(a)];

/** x if it is a typed array of class C whose length is its own, else a TypeError. */
export function typedArray(what, x, C) {
  if (!(x instanceof C)) throw new TypeError(`${what}: expected a ${C.name}, got ${x?.constructor?.name ?? typeof x}`);
  if (x.length !== lengthOf.call(x) || x.byteLength !== byteLengthOf.call(x)) {
    throw new TypeError(`${what}: a ${C.name} whose length or byteLength is overridden`);
  }
  return x;
}

/** `rows` rows (1 .. I32_MAX) of k values (a positive multiple of the block) of stored blocks:
 * a Uint8Array of exactly their bytes, else a TypeError or RangeError. */
export function checkBlocks(what, spec, blocks, rows, k) {
  typedArray(`${what} blocks`, blocks, Uint8Array);
  for (const [name, v] of [['rows', rows], ['k', k]]) {
    if (!Number.isInteger(v) || v < 1 || v > I32_MAX) throw new RangeError(`${what} ${name}: expected an integer in 1..${I32_MAX}, got ${v}`);
  }
  if (k % spec.block) throw new RangeError(`${what}: k=${k} is not a multiple of the block, ${spec.block}`);
  const nblocks = rows * (k / spec.block);
  if (blocks.length !== nblocks * spec.stored_bytes) {
    throw new RangeError(`${what}: ${rows} rows of ${k} need ${nblocks * spec.stored_bytes} bytes `
      + `(${nblocks} blocks of ${spec.stored_bytes}), got ${blocks.length}`);
  }
}

/** IEEE binary16 bits (0 .. 65535) -> the number (exact: every half is a float32). A lookup in a
 * table of every half's value, made on first use: 5x faster than computing it (an F16 tensor of
 * 10^7 values, a scale per block). */
export function halfToFloat(h) {
  if (halves === null) halves = Float32Array.from({ length: 65536 }, (_, bits) => halfValue(bits));
  return halves[h];
}

let halves = null;

function halfValue(h) {
  const sign = h & 0x8000 ? -1 : 1;
  const exp = (h >> 10) & 0x1f;
  const frac = h & 0x3ff;
  if (exp === 0) return sign * frac * 2 ** -24;
  if (exp === 0x1f) return frac ? NaN : sign * Infinity;
  return sign * (1024 + frac) * 2 ** (exp - 25);
}

// ---- formulas ----------------------------------------------------------------------------------
// A formula is the manifest's JSON tree (kernelgen/quantformat.py: {kind, attributes, args}). One
// walker, `fold`, calls the consumer's method for the node's kind with its children's results. The
// consumer below compiles a tree for a Chunk, a run of consecutive stored blocks: evaluated at x
// (the element index i for unpack, the sub-block index s for a super-block's scale and offset), a
// node gives its value in every block of the chunk, a loop per node over the blocks rather than a
// call per node and value. A node is `pure` when it reads no block: `value(x)` is then a number,
// computed once per x (Q4_K's byte index and shift of element i). Otherwise `at(x)` returns a typed
// array whose first chunk.n entries hold its values, computed once per chunk when x does not
// matter (a scale field). As in quantformat.NumpyEval, integers stay int32 until they meet a float;
// then both sides are float32, rounded after every operation; both branches of a select are
// computed, as numpy's `where` does (the build checks that every index stays inside its field).

function fold(tree, consumer) {
  const visit = consumer[tree.kind];
  if (!visit) throw new Error(`formula: no ${tree.kind} node here`);
  return visit(tree, ...(tree.args ?? []).map((t) => fold(t, consumer)));
}

const CHUNK = 256; // blocks evaluated together: a node's values take 1-2 KB
const PACK_VALUES = 1 << 16; // values of a grouped type packed row by row before grouping (quantformat.PACK_VALUES)

/** Stored blocks b0 .. b0 + n - 1 of the bytes in use, `stride` bytes each: what the formulas read. */
class Chunk {
  constructor(stride) {
    this.stride = stride;
    this.o = 0; // the byte offset of block b0
    this.n = 0;
    this.serial = 0; // which chunk this is, for the values kept per chunk
  }

  use(bytes) {
    this.u8 = bytes;
    this.i8 = new Int8Array(bytes.buffer, bytes.byteOffset, bytes.byteLength);
    this.view = new DataView(bytes.buffer, bytes.byteOffset, bytes.byteLength);
  }

  select(b0, n) {
    this.o = b0 * this.stride;
    this.n = n;
    this.serial++;
  }

  /** out[j] = the field of `type` at byte `offset` of block j. */
  read(type, offset, out) {
    const { n, stride, view } = this;
    if (type === 'u8' || type === 'i8') {
      const bytes = type === 'u8' ? this.u8 : this.i8;
      for (let j = 0, p = this.o + offset; j < n; j++, p += stride) out[j] = bytes[p];
    } else {
      const get = FIELD_READERS[type];
      for (let j = 0, p = this.o + offset; j < n; j++, p += stride) out[j] = get(view, p);
    }
    return out;
  }

  /** out[j] = `mask` of byte `offset` of block j shifted right by `shift`. */
  bits(offset, shift, mask, out) {
    const { n, stride, u8 } = this;
    for (let j = 0, p = this.o + offset; j < n; j++, p += stride) out[j] = (u8[p] >> shift) & mask;
    return out;
  }
}

const isInt = (type) => type[0] !== 'f';
// a field's values: a u32 is kept whole (it meets only floats), other integers as int32
const fieldArray = (type) => (type === 'u32' ? Float64Array : isInt(type) ? Int32Array : Float32Array);

// Element-wise loops, `out[j] = a[j] op b[j]` for j < n; the typed array `out` rounds: an Int32Array
// wraps as `| 0` does, a Float32Array rounds to float32 as Math.fround does.
const INT_LOOPS = {
  '+': (out, n, a, b) => { for (let j = 0; j < n; j++) out[j] = a[j] + b[j]; },
  '-': (out, n, a, b) => { for (let j = 0; j < n; j++) out[j] = a[j] - b[j]; },
  '*': (out, n, a, b) => { for (let j = 0; j < n; j++) out[j] = Math.imul(a[j], b[j]); },
  '/': (out, n, a, b) => { for (let j = 0; j < n; j++) out[j] = Math.floor(a[j] / b[j]); }, // by 0: 0
  '%': (out, n, a, b) => { for (let j = 0; j < n; j++) out[j] = ((a[j] % b[j]) + b[j]) % b[j]; }, // numpy's sign
  '&': (out, n, a, b) => { for (let j = 0; j < n; j++) out[j] = a[j] & b[j]; },
  '|': (out, n, a, b) => { for (let j = 0; j < n; j++) out[j] = a[j] | b[j]; },
  '<<': (out, n, a, b) => { for (let j = 0; j < n; j++) out[j] = a[j] << b[j]; },
  '>>': (out, n, a, b) => { for (let j = 0; j < n; j++) out[j] = a[j] >> b[j]; },
  '<': (out, n, a, b) => { for (let j = 0; j < n; j++) out[j] = a[j] < b[j] ? 1 : 0; },
};
// '+' and '-' read as INT_LOOPS' do, but are functions of their own: each loop then sees one kind of
// typed array (Float32Array here, Int32Array there), which V8 compiles tighter than a shared one.
const FLOAT_LOOPS = {
  '+': (out, n, a, b) => { for (let j = 0; j < n; j++) out[j] = a[j] + b[j]; },
  '-': (out, n, a, b) => { for (let j = 0; j < n; j++) out[j] = a[j] - b[j]; },
  '*': (out, n, a, b) => { for (let j = 0; j < n; j++) out[j] = a[j] * b[j]; },
  '/': (out, n, a, b) => { for (let j = 0; j < n; j++) out[j] = a[j] / b[j]; },
};
// The same with a right operand that reads no block, one number for the chunk (a shift, a mask, a
// zero): no array filled with it, one array read fewer (FLOAT_BY's number is a float32 already).
const INT_BY = {
  '+': (out, n, a, c) => { for (let j = 0; j < n; j++) out[j] = a[j] + c; },
  '-': (out, n, a, c) => { for (let j = 0; j < n; j++) out[j] = a[j] - c; },
  '*': (out, n, a, c) => { for (let j = 0; j < n; j++) out[j] = Math.imul(a[j], c); },
  '&': (out, n, a, c) => { for (let j = 0; j < n; j++) out[j] = a[j] & c; },
  '|': (out, n, a, c) => { for (let j = 0; j < n; j++) out[j] = a[j] | c; },
  '<<': (out, n, a, c) => { for (let j = 0; j < n; j++) out[j] = a[j] << c; },
  '>>': (out, n, a, c) => { for (let j = 0; j < n; j++) out[j] = a[j] >> c; },
};
const FLOAT_BY = {
  '+': (out, n, a, c) => { for (let j = 0; j < n; j++) out[j] = a[j] + c; },
  '-': (out, n, a, c) => { for (let j = 0; j < n; j++) out[j] = a[j] - c; },
  '*': (out, n, a, c) => { for (let j = 0; j < n; j++) out[j] = a[j] * c; },
  '/': (out, n, a, c) => { for (let j = 0; j < n; j++) out[j] = a[j] / c; },
};
const NEG = (out, n, a) => { for (let j = 0; j < n; j++) out[j] = -a[j]; };
const POW2 = (out, n, a) => { for (let j = 0; j < n; j++) out[j] = 2 ** a[j]; };
const SELECT = (out, n, c, a, b) => { for (let j = 0; j < n; j++) out[j] = c[j] !== 0 ? a[j] : b[j]; };
const lookupLoop = (table) => (out, n, c) => { for (let j = 0; j < n; j++) out[j] = table[c[j]]; };

/** A node that reads no block, computed once per x. */
function pureNode(int, usesX, f) {
  const memo = [];
  return { int, pure: true, usesX, value: (x) => memo[x] ?? (memo[x] = f(x)) };
}

/** A node that reads blocks: `fill(x)` computes its values for the chunk, once per chunk if x does not matter. */
function blockNode(chunk, int, usesX, fill) {
  if (usesX) return { int, pure: false, usesX, at: fill };
  let serial = -1;
  let last = null;
  return { int, pure: false, usesX, at: (x) => (serial === chunk.serial ? last : ((serial = chunk.serial), (last = fill(x)))) };
}

/** A function of x giving node c's values in the chunk as an array (a pure value repeated, an
 * integer widened to float32 first if `float`): how a node enters a loop. */
function valuesOf(chunk, c, float = false) {
  if (c.pure) {
    const values = new (float || !c.int ? Float32Array : Int32Array)(CHUNK);
    return (x) => values.fill(c.value(x), 0, chunk.n);
  }
  if (!float || !c.int) return c.at;
  const values = new Float32Array(CHUNK);
  return (x) => {
    const a = c.at(x);
    for (let j = 0, n = chunk.n; j < n; j++) values[j] = a[j];
    return values;
  };
}

/** A node computed by `loop` from its children, child k widened to float32 if floats[k]; pure if they all are. */
function elementwise(chunk, int, loop, children, floats) {
  const Out = int ? Int32Array : Float32Array;
  if (children.every((c) => c.pure)) { // a one-value loop: the same rounding
    const ones = children.map((c, k) => new (floats[k] || !c.int ? Float32Array : Int32Array)(1));
    const out = new Out(1);
    return pureNode(int, children.some((c) => c.usesX), (x) => {
      children.forEach((c, k) => { ones[k][0] = c.value(x); });
      loop(out, 1, ...ones);
      return out[0];
    });
  }
  const args = children.map((c, k) => valuesOf(chunk, c, floats[k]));
  const out = new Out(CHUNK);
  return blockNode(chunk, int, children.some((c) => c.usesX), (x) => {
    loop(out, chunk.n, ...args.map((f) => f(x)));
    return out;
  });
}

/** a op b for a node `a` that reads blocks and a pure `b`, by a loop of INT_BY or FLOAT_BY (a and b
 * widened to float32 first where the op is a float one, as elementwise does). */
function byNumber(chunk, int, loop, a, b) {
  const values = valuesOf(chunk, a, !int);
  const number = int ? (x) => b.value(x) : (x) => Math.fround(b.value(x));
  const out = new (int ? Int32Array : Float32Array)(CHUNK);
  return blockNode(chunk, int, a.usesX || b.usesX, (x) => {
    loop(out, chunk.n, values(x), number(x));
    return out;
  });
}

// where element x of a nib/nibi/bit field lies: [byte, shift, mask]
const CALLS = {
  // nib: element i is the low nibble of byte i for i < n, else the high nibble of byte i - n
  nib: (x, n) => (x < n ? [x, 0, 15] : [x - n, 4, 15]),
  // nibi: element i is nibble i & 1 of byte i >> 1 (ONNX UINT4)
  nibi: (x) => [x >> 1, 4 * (x & 1), 15],
  // bit: bit i of the little-endian mask
  bit: (x) => [x >> 3, x & 7, 1],
};

const NO_SHIFT = () => 0;

const formulaConsumer = (fields, chunk) => ({
  int: (t) => pureNode(true, false, () => t.value | 0),
  float: (t) => pureNode(false, false, () => Math.fround(t.value)),
  i: () => pureNode(true, true, (x) => x),
  s: () => pureNode(true, true, (x) => x),
  field: (t) => {
    const f = fields[t.field];
    const out = new (fieldArray(f.type))(CHUNK);
    return blockNode(chunk, isInt(f.type), false, () => chunk.read(f.type, f.offset, out));
  },
  index: (t, at) => {
    const f = fields[t.field];
    const out = new (fieldArray(f.type))(CHUNK);
    // the build checks that an index is a formula of the element or sub-block alone (compiler/quant.py)
    if (!at.pure) throw new Error(`formula: the index of ${t.field} reads the block; rebuild with \`kernelgen build\``);
    const byte = (x) => f.offset + FIELD_BYTES[f.type] * at.value(x);
    const node = blockNode(chunk, isInt(f.type), at.usesX, (x) => chunk.read(f.type, byte(x), out));
    return f.type === 'u8' ? { ...node, byte, shift: NO_SHIFT } : node; // see op's `bits`
  },
  call: (t) => {
    const f = fields[t.field];
    const where = CALLS[t.func];
    if (!where) throw new Error(`unpack: unknown function ${t.func}`);
    const out = new Int32Array(CHUNK);
    return blockNode(chunk, true, true, (x) => {
      const [byte, shift, mask] = where(x, f.count);
      return chunk.bits(f.offset + byte, shift, mask, out);
    });
  },
  lookup: (t, code) => elementwise(chunk, true, lookupLoop(Int32Array.from(t.values)), [code], [false]),
  pow2: (t, a) => elementwise(chunk, false, POW2, [a], [false]),
  select: (t, c, a, b) => {
    const int = a.int && b.int; // one float branch: both are (numpy's where)
    return elementwise(chunk, int, SELECT, [c, a, b], [false, !int, !int]);
  },
  neg: (t, a) => elementwise(chunk, a.int, NEG, [a], [false]),
  op: (t, a, b) => {
    const int = a.int && b.int; // an integer meets a float as a float32 first (quantformat.NumpyEval.on_op)
    const loop = (int ? INT_LOOPS : FLOAT_LOOPS)[t.op];
    if (!loop) throw new Error(`formula: unknown operator ${t.op}`);
    // (u8 field[offset of x] >> shift) & mask, shift and mask read no block: one pass, as nib() (the K-quants' bits)
    const bits = a.byte && b.pure && (t.op === '&' || (t.op === '>>' && a.shift === NO_SHIFT));
    if (bits && t.op === '&') {
      const out = new Int32Array(CHUNK);
      return blockNode(chunk, true, true, (x) => chunk.bits(a.byte(x), a.shift(x), b.value(x), out));
    }
    const by = !a.pure && b.pure && (int ? INT_BY : FLOAT_BY)[t.op];
    const node = by ? byNumber(chunk, int, by, a, b) : elementwise(chunk, int, loop, [a, b], [!int, !int]);
    return bits ? { ...node, byte: a.byte, shift: b.value } : node;
  },
});

// A super-block's kernel blocks in plane q (quantformat.ENCODINGS, byte for byte): where element e
// of a kernel block of n values goes, [byte, shift, mask] of its integer minus the zero.
const ENCODERS = {
  crumb: (e, n) => [e % (n / 4), 2 * Math.floor(e / (n / 4)), 3],
  nib: (e, n) => (e < n / 2 ? [e, 0, 15] : [e - n / 2, 4, 15]),
  byte: (e) => [e, 0, 255],
};

// ---- packing -----------------------------------------------------------------------------------

/** Rows the planes of a `rows`-row matrix hold: whole groups (QuantFormat.padded_rows). */
export function paddedRows(spec, rows) {
  return Math.ceil(rows / spec.group) * spec.group;
}

/** Plane name -> {Array: typed array constructor, perBlock: elements per stored block and row}, in
 * the order the kernels take the planes as arguments (a super-block holds several kernel blocks);
 * a plane of a rows x k matrix holds perBlock * paddedRows(spec, rows) * k / spec.block. */
export function planeLayout(spec) {
  const kernelBlocks = spec.block / (spec.kernel_block ?? spec.block);
  const out = {};
  for (const [name, p] of Object.entries(spec.planes)) {
    const Array = PLANE_ARRAYS[p.dtype];
    if (!Array) throw new Error(`plane ${name}: unsupported dtype ${p.dtype}`);
    out[name] = { Array, perBlock: kernelBlocks * p.bytes_per_block / Array.BYTES_PER_ELEMENT };
  }
  return out;
}

/**
 * Pack `rows` rows of k values in stored blocks (bytes, `spec.stored_bytes` each) into `planes`,
 * typed arrays of planeLayout(spec)'s types and lengths (e.g. views of wasm memory).
 */
export function packInto(spec, blocks, rows, k, planes) {
  const nb = k / spec.block; // stored blocks per row
  const packRows = rowPacker(spec);
  if (spec.group === 1) {
    packRows(blocks, rows * nb, planes, 0);
    return;
  }
  // row by row into scratch planes, then grouped: whole groups of rows at a time, a part's
  // scratch staying in L2 and its grouped bytes contiguous in each plane
  const padded = paddedRows(spec, rows);
  const perRow = nb * spec.stored_bytes;
  const step = Math.max(1, Math.floor(PACK_VALUES / (k * spec.group))) * spec.group;
  const layout = Object.entries(planeLayout(spec));
  const scratch = Object.fromEntries(layout.map(([name, { Array, perBlock }]) => [name, new Array(perBlock * Math.min(step, padded) * nb)]));
  const kernelBlocks = k / (spec.kernel_block ?? spec.block);
  for (let r0 = 0; r0 < padded; r0 += step) {
    const n = Math.min(step, padded - r0);
    let part = blocks.subarray(r0 * perRow, Math.min(r0 + n, rows) * perRow);
    if (r0 + n > rows) { // zero blocks past the rows: whole groups
      part = new Uint8Array(n * perRow);
      part.set(blocks.subarray(r0 * perRow, rows * perRow));
    }
    const byRow = Object.fromEntries(layout.map(([name, { perBlock }]) => [name, scratch[name].subarray(0, perBlock * n * nb)]));
    packRows(part, n * nb, byRow, r0 * nb);
    for (const [name, plane] of Object.entries(planes)) {
      const units = name === 'scale' && spec.record ? nb : kernelBlocks;
      const src = new Uint8Array(byRow[name].buffer, 0, byRow[name].byteLength);
      const bytes = src.length / (n * units);
      const dst = new Uint8Array(plane.buffer, plane.byteOffset + r0 * units * bytes, n * units * bytes);
      grouped(src, dst, n, units, bytes, spec.group, spec.planes[name].granules, name);
    }
  }
}

/** `src`, a plane packed row by row (rows x units records of `bytes` bytes), into `dst` in the
 * grouped layout: group-major, then unit-major, each record's granules with the group's rows side
 * by side, as the manifest's `granules` for plane `name` ([from, to, granule bytes] of a record) say. */
function grouped(src, dst, rows, units, bytes, group, granules, name) {
  const covers = Array.isArray(granules) && granules.length > 0 && granules.at(-1)[1] === bytes
    && granules.every(([from, to, granule], i) => from === (i ? granules[i - 1][1] : 0) && to > from
      && Number.isInteger(granule) && granule > 0 && (to - from) % granule === 0);
  if (!covers) {
    throw new Error(`plane '${name}' of the grouped layout: its granules must cover its ${bytes} bytes per record, got `
      + `${JSON.stringify(granules)}; rebuild with \`kernelgen build\``);
  }
  // each range copied in the widest words that its granule, the record and both arrays' offsets allow
  // (offsets in bytes stay multiples of the word: a record, and a range's start in a group, are)
  const ranges = granules.map(([from, to, granule]) => {
    const w = [4, 2, 1].find((b) => (granule | bytes | from | src.byteOffset | dst.byteOffset) % b === 0);
    const Words = { 4: Uint32Array, 2: Uint16Array, 1: Uint8Array }[w];
    return { from: from / w, to: to / w, granule: granule / w, w, s: new Words(src.buffer, src.byteOffset, src.length / w),
      d: new Words(dst.buffer, dst.byteOffset, dst.length / w) };
  });
  let o = 0; // bytes written
  for (let g = 0; g < rows / group; g++) {
    for (let u = 0; u < units; u++) {
      for (const { from, to, granule, w, s, d } of ranges) {
        const record = bytes / w;
        const at0 = (g * group * units + u) * record;
        let ow = o / w;
        for (let c = from; c < to; c += granule) {
          for (let r = 0, at = at0 + c; r < group; r++, at += units * record) {
            for (let j = 0; j < granule; j++) d[ow + j] = s[at + j]; // (a subarray per granule cost more)
            ow += granule;
          }
        }
        o = ow * w;
      }
    }
  }
}

/** packInto for rows one by one, its formulas compiled once: a function packing `nblocks` stored
 * blocks, each row's in turn (the first block number `first` of the matrix, for errors), into
 * `planes`, a chunk of blocks at a time and within it a formula value (element, sub-block) at a time. */
function rowPacker(spec) {
  const fields = Object.fromEntries(spec.fields.map((f) => [f.name, { ...f, count: f.count ?? 1 }]));
  const chunk = new Chunk(spec.stored_bytes);
  const consumer = formulaConsumer(fields, chunk);
  const compile = (tree) => valuesOf(chunk, fold(tree, consumer));
  const kernelBlock = spec.kernel_block ?? spec.block;
  const per = spec.block / kernelBlock; // kernel blocks per stored block, each with its scale (s)
  // the integers plane q holds (QuantFormat.encoded): the unpacked values, or a codebook
  // super-block's codes (its table's entries are int8 by declaration)
  const encoded = compile(spec.encoding?.code ?? spec.formulas.unpack);
  // a zero point read from the block must suit the relaxed dot's 7-bit operand (QuantFormat.codes)
  const zeros = spec.codes?.zero.kind === 'field' ? compile(spec.codes.zero) : null;
  if (spec.encoding && !Object.hasOwn(ENCODERS, spec.encoding.kind)) {
    throw new Error(`this runtime cannot pack codes encoded as ${JSON.stringify(spec.encoding.kind)} (it knows ${Object.keys(ENCODERS).join(', ')}): use the runtime of the kernelgen that built the library`);
  }
  const encode = spec.encoding ? ENCODERS[spec.encoding.kind] : null;
  const zero = spec.encoding?.zero ?? 0;
  // sub-blocks smaller than the kernel block: scale = F (per super-block) * I(s) (plane sub)
  const split = spec.sub_scales && { f: compile(spec.sub_scales.block), i: compile(spec.sub_scales.sub) };
  const halves = split ? kernelBlock / spec.sub : 1;
  const subWidth = spec.group > 1 ? SUB_SCALE_GRANULE : 4;
  const record = spec.record && {
    ...spec.record,
    // kernel block k's integer is sub-block k * kernelBlock / spec.sub's
    factors: Object.values(spec.record.factors).map((x) => ({ ...x, f: compile(x.f), i: x.i && compile(x.i), per: x.per ?? 1 })),
  };
  const scale = record || split ? null : compile(spec.formulas.scale);
  const offset = !record && spec.formulas.offset ? compile(spec.formulas.offset) : null;
  const interleaved = new Set(spec.interleaved);
  const qBytes = spec.planes.q.bytes_per_block;
  // a flat block's value fields as stored, each `times` times (a scalar byte field takes a granule
  // in the grouped layout: QuantFormat.value_width)
  let at = 0;
  const copies = encode ? [] : spec.value_fields.map((name) => {
    const f = fields[name];
    const nbytes = f.count * FIELD_BYTES[f.type];
    const times = spec.group > 1 && spec.fields.find((x) => x.name === name).count === null ? GRANULE / nbytes : 1;
    const copy = { from: f.offset, nbytes, at, times, interleaved: interleaved.has(name) };
    at += nbytes * times;
    return copy;
  });
  return (blocks, nblocks, planes, first) => {
    chunk.use(blocks);
    const { q } = planes;
    const recordView = record && new DataView(planes.scale.buffer, planes.scale.byteOffset, planes.scale.byteLength);
    const recordBytes = record && new Uint8Array(planes.scale.buffer, planes.scale.byteOffset, planes.scale.byteLength);
    for (let b0 = 0; b0 < nblocks; b0 += CHUNK) {
      const n = Math.min(CHUNK, nblocks - b0);
      chunk.select(b0, n);
      let bad = null; // the chunk's first invalid block, {j, message}
      for (let i = 0; i < spec.block; i++) { // every element's integer, int8 (the kernels' lanes), re-encoded if the type is
        const u = encoded(i);
        const limit = bad ? bad.j : n; // blocks past an invalid one need neither check nor code
        let j;
        if (encode) {
          const [byte, shift, mask] = encode(i % kernelBlock, kernelBlock);
          j = encodeColumn(u, limit, zero, shift, mask, q, (b0 * per + Math.floor(i / kernelBlock)) * qBytes + byte, per * qBytes);
        } else {
          j = firstOutside(u, limit, INT8_MIN, INT8_MAX);
        }
        if (j >= 0) bad = { j, message: `unpacks to ${u[j]} at element ${i}, outside int8: not a valid block of this type (the kernels' weights are int8)` };
      }
      const z = zeros?.(0);
      const zj = z ? firstOutside(z, bad ? bad.j : n, 0, 127) : -1;
      if (zj >= 0) bad = { j: zj, message: `has ${spec.codes.zero.field} = ${z[zj]}, outside 0..127: not a valid block of this type (the relaxed dot's 7-bit operand takes it)` };
      if (bad) throw new RangeError(`block ${first + b0 + bad.j} ${bad.message}`);
      for (const c of copies) {
        for (let j = 0; j < n; j++) {
          const from = (b0 + j) * spec.stored_bytes + c.from;
          const to = (b0 + j) * qBytes + c.at;
          if (c.interleaved) splitNibbles(blocks, from, c.nbytes, q, to);
          else for (let t = 0; t < c.times * c.nbytes; t++) q[to + t] = blocks[from + (t % c.nbytes)];
        }
      }
      // a super-block's record: F as f32, I a byte per kernel block (`per` bytes: an offset's I of
      // each of its sub-blocks of 16, Q2_K's)
      for (const x of record?.factors ?? []) {
        const f = x.f(0);
        for (let j = 0; j < n; j++) recordView.setFloat32((b0 + j) * record.bytes + x.f_at, f[j], true);
        for (let k = 0; x.i && k < record.blocks * x.per; k++) {
          const v = x.i(Math.floor((k * kernelBlock) / (spec.sub * x.per)));
          for (let j = 0, p = b0 * record.bytes + x.i_at + k; j < n; j++, p += record.bytes) recordBytes[p] = v[j];
        }
      }
      for (let s = 0; s < per; s++) {
        const sc = record ? null : scale ? scale(s) : split.f(0);
        const off = offset?.(s);
        for (let j = 0, k = b0 * per + s; j < n; j++, k += per) {
          if (sc) planes.scale[k] = sc[j];
          if (off) planes.offset[k] = off[j];
        }
        // the sub-blocks' integer scales follow the kernel block's codes in plane q (quantformat.SUB_SCALES):
        // rows one by one an i32 each holding the scale in both little-endian i16 halves, grouped an int8 twice
        for (let h = 0; split && h < halves; h++) {
          const v = split.i(s * halves + h);
          let p = (b0 * per + s + 1) * qBytes - subWidth * (halves - h);
          for (let j = 0; j < n; j++, p += per * qBytes) {
            for (let c = 0; c < subWidth; c++) q[p + c] = spec.group > 1 || c % 2 === 0 ? v[j] : v[j] >> 8;
          }
        }
      }
    }
  };
}

/** The first j < n with values[j] outside lo..hi, else -1. */
function firstOutside(values, n, lo, hi) {
  for (let j = 0; j < n; j++) if (values[j] < lo || values[j] > hi) return j;
  return -1;
}

/** Integers u[0 .. n) minus `zero`, `mask` of them shifted left by `shift`, into q from byte p every
 * `stride` bytes (a shifted field joins what the byte holds: the high nibble), up to the first outside
 * int8: its j, else -1 (firstOutside's check in the same pass). */
function encodeColumn(u, n, zero, shift, mask, q, p, stride) {
  for (let j = 0; j < n; j++, p += stride) {
    const v = u[j];
    if (v < INT8_MIN || v > INT8_MAX) return j;
    q[p] = (shift ? q[p] : 0) | (((v - zero) & mask) << shift);
  }
  return -1;
}

/** Interleaved nibbles (element 2i low, 2i+1 high) of `n` bytes from src[from] -> split nibbles
 * (byte j holds elements j and j + n) from dst[at], the order the kernels' two-instruction nibble
 * unpack reads. */
function splitNibbles(src, from, n, dst, at) {
  const elem = (e) => (src[from + (e >> 1)] >> (4 * (e & 1))) & 15;
  for (let j = 0; j < n; j++) dst[at + j] = elem(j) | (elem(j + n) << 4);
}

/** Pack `rows` rows of k values into fresh typed arrays: {q, scale, offset?}. */
export function packPlanes(spec, blocks, rows, k) {
  if (spec === null || typeof spec !== 'object' || typeof spec.block !== 'number' || typeof spec.planes !== 'object') {
    throw new TypeError('packPlanes: spec must be a quant type of a manifest (manifest.quants[name])');
  }
  checkBlocks('packPlanes', spec, blocks, rows, k);
  const planes = {};
  for (const [name, { Array, perBlock }] of Object.entries(planeLayout(spec))) {
    planes[name] = new Array(perBlock * paddedRows(spec, rows) * (k / spec.block));
  }
  packInto(spec, blocks, rows, k, planes);
  return planes;
}
