// Packing stored quant blocks into the planes the kernels read, from the manifest alone.
//
// Mirrors QuantFormat.pack in kernelgen/quantformat.py: the manifest's "quants" entry of a type gives its
// fields, value fields, interleaved fields and its formulas as JSON trees, so any declared type
// packs here without code of its own. Planes (each contiguous, row-major, one entry per block):
//   q       the value fields' bytes, concatenated in "value_fields" order ("interleaved" nibble
//           fields repacked from ONNX order, element 2i low / 2i+1 high, to split order)
//   scale   f32: the "scale" formula (f16 fields widened); for a type with a "record" (super-blocks
//           whose scale and offset are F * I), one record of "record.bytes" per stored block: each
//           factor's F as f32 at f_at, its I as a byte per kernel block from i_at
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
// consumer below turns a tree into {int, at}: `at(v, o, x)` evaluates it on the block read through
// DataView `v` at byte offset `o`, where x is the element index i (unpack) or the sub-block index
// s (a super-block's scale and offset). As in quantformat.NumpyEval, integers stay int32 until they
// meet a float; then both sides are float32, rounded after every operation.

function fold(tree, consumer) {
  const visit = consumer[tree.kind];
  if (!visit) throw new Error(`formula: no ${tree.kind} node here`);
  return visit(tree, ...(tree.args ?? []).map((t) => fold(t, consumer)));
}

const r = Math.fround;
const INT_OPS = {
  '+': (a, b) => (a + b) | 0,
  '-': (a, b) => (a - b) | 0,
  '*': (a, b) => Math.imul(a, b),
  '/': (a, b) => Math.floor(a / b) | 0,
  '%': (a, b) => (((a % b) + b) % b) | 0,
  '&': (a, b) => a & b,
  '|': (a, b) => a | b,
  '<<': (a, b) => a << b,
  '>>': (a, b) => a >> b,
  '<': (a, b) => (a < b ? 1 : 0),
};
const FLOAT_OPS = { '+': (a, b) => r(a + b), '-': (a, b) => r(a - b), '*': (a, b) => r(a * b), '/': (a, b) => r(a / b) };

const isInt = (type) => type[0] !== 'f';

/** A node computed from its children: `pure` when nothing beneath reads the block (a function of x
 * alone), and then computed once per x. So a formula's x-only parts (Q4_K's byte index and shift of
 * element i) cost a lookup per element instead of their operations: the K-quants pack 2-3x faster. */
function derived(int, at, ...children) {
  if (!children.every((c) => c.pure)) return { int, pure: false, at };
  const memo = [];
  return { int, pure: true, at: (v, o, x) => memo[x] ?? (memo[x] = at(v, o, x)) };
}

const formulaConsumer = (fields) => ({
  int: (t) => ({ int: true, pure: true, constant: t.value | 0, at: () => t.value | 0 }),
  float: (t) => ({ int: false, pure: true, at: () => r(t.value) }),
  i: () => ({ int: true, pure: true, at: (v, o, x) => x }),
  s: () => ({ int: true, pure: true, at: (v, o, x) => x }),
  field: (t) => {
    const f = fields[t.field];
    const read = FIELD_READERS[f.type];
    return { int: isInt(f.type), pure: false, at: (v, o) => read(v, o + f.offset) };
  },
  index: (t, at) => {
    const f = fields[t.field];
    const read = FIELD_READERS[f.type];
    const size = FIELD_BYTES[f.type];
    if (at.pure) { // the byte's offset in the block, once per x
      const offsets = [];
      return { int: isInt(f.type), pure: false, at: (v, o, x) => read(v, o + (offsets[x] ?? (offsets[x] = f.offset + size * at.at(v, o, x)))) };
    }
    return { int: isInt(f.type), pure: false, at: (v, o, x) => read(v, o + f.offset + size * at.at(v, o, x)) };
  },
  call: (t) => {
    const f = fields[t.field];
    const n = f.count;
    switch (t.func) {
      // nib: element i is the low nibble of byte i for i < n, else the high nibble of byte i - n
      case 'nib': return { int: true, pure: false, at: (v, o, i) => (i < n ? v.getUint8(o + f.offset + i) & 15 : v.getUint8(o + f.offset + i - n) >> 4) };
      // nibi: element i is nibble i & 1 of byte i >> 1 (ONNX UINT4)
      case 'nibi': return { int: true, pure: false, at: (v, o, i) => (v.getUint8(o + f.offset + (i >> 1)) >> (4 * (i & 1))) & 15 };
      // bit: bit i of the little-endian mask
      case 'bit': return { int: true, pure: false, at: (v, o, i) => (v.getUint8(o + f.offset + (i >> 3)) >> (i & 7)) & 1 };
      default: throw new Error(`unpack: unknown function ${t.func}`);
    }
  },
  lookup: (t, code) => derived(true, (v, o, x) => t.values[code.at(v, o, x)], code),
  pow2: (t, a) => derived(false, (v, o, x) => r(2 ** a.at(v, o, x)), a),
  select: (t, c, a, b) => {
    if (a.int === b.int) return derived(a.int, (v, o, x) => (c.at(v, o, x) !== 0 ? a : b).at(v, o, x), c, a, b);
    const f = (e) => (e.int ? (v, o, x) => r(e.at(v, o, x)) : e.at); // one float branch: both are (numpy's where)
    const fa = f(a);
    const fb = f(b);
    return derived(false, (v, o, x) => (c.at(v, o, x) !== 0 ? fa : fb)(v, o, x), c, a, b);
  },
  neg: (t, a) => derived(a.int, a.int ? (v, o, x) => -a.at(v, o, x) | 0 : (v, o, x) => -a.at(v, o, x), a),
  op: (t, a, b) => {
    const int = a.int && b.int;
    const op = (int ? INT_OPS : FLOAT_OPS)[t.op];
    if (!op) throw new Error(`formula: unknown operator ${t.op}`);
    if (int && b.constant !== undefined) return derived(int, (v, o, x) => op(a.at(v, o, x), b.constant), a, b);
    if (int) return derived(int, (v, o, x) => op(a.at(v, o, x), b.at(v, o, x)), a, b);
    // an integer meets a float as a float32 first, as in numpy (quantformat.NumpyEval.on_op)
    const fa = a.int ? (v, o, x) => r(a.at(v, o, x)) : a.at;
    const fb = b.int ? (v, o, x) => r(b.at(v, o, x)) : b.at;
    return derived(int, (v, o, x) => op(fa(v, o, x), fb(v, o, x)), a, b);
  },
});

// A super-block's kernel blocks in plane q, from their integers minus the zero (u, 32 values):
// quantformat.ENCODINGS, byte for byte.
const ENCODERS = {
  nib: (u, dst) => {
    for (let j = 0; j < 16; j++) dst[j] = (u[j] & 15) | ((u[j + 16] & 15) << 4);
  },
  byte: (u, dst) => {
    for (let j = 0; j < u.length; j++) dst[j] = u[j] & 255;
  },
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
  if (spec.group === 1) {
    packRows(spec, blocks, rows * (k / spec.block), planes);
    return;
  }
  const padded = paddedRows(spec, rows);
  const perRow = (k / spec.block) * spec.stored_bytes;
  const all = new Uint8Array(padded * perRow); // zero blocks past the rows: whole groups
  all.set(blocks.subarray(0, rows * perRow));
  const byRow = {};
  for (const [name, { Array, perBlock }] of Object.entries(planeLayout(spec))) byRow[name] = new Array(perBlock * padded * (k / spec.block));
  packRows(spec, all, padded * (k / spec.block), byRow);
  const kernelBlocks = k / (spec.kernel_block ?? spec.block);
  for (const [name, plane] of Object.entries(planes)) {
    const record = name === 'scale' && spec.record;
    const units = record ? k / spec.block : kernelBlocks;
    const src = new Uint8Array(byRow[name].buffer);
    const bytes = src.length / (padded * units);
    const dst = new Uint8Array(plane.buffer, plane.byteOffset, plane.byteLength);
    grouped(src, dst, padded, units, bytes, spec.group, spec.planes[name].granules, name);
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
  let o = 0;
  for (let g = 0; g < rows / group; g++) {
    for (let u = 0; u < units; u++) {
      for (const [from, to, granule] of granules) {
        for (let c = from; c < to; c += granule) {
          for (let r = 0; r < group; r++) {
            const at = ((g * group + r) * units + u) * bytes + c;
            for (let j = 0; j < granule; j++) dst[o + j] = src[at + j]; // (a subarray per granule of 4 bytes cost more)
            o += granule;
          }
        }
      }
    }
  }
}

/** packInto for rows one by one: `nblocks` stored blocks, each row's in turn. */
function packRows(spec, blocks, nblocks, planes) {
  const fields = Object.fromEntries(spec.fields.map((f) => [f.name, { ...f, count: f.count ?? 1 }]));
  const consumer = formulaConsumer(fields);
  const { unpack, scale, offset } = spec.formulas;
  const unpackAt = fold(unpack, consumer).at;
  const scaleAt = fold(scale, consumer).at;
  const offsetAt = offset ? fold(offset, consumer).at : null;
  // a zero point read from the block must suit the relaxed dot's 7-bit operand (QuantFormat.codes)
  const zeroAt = spec.codes?.zero.kind === 'field' ? fold(spec.codes.zero, consumer).at : null;
  const kernelBlock = spec.kernel_block ?? spec.block;
  const per = spec.block / kernelBlock; // kernel blocks per stored block, each with its scale (s)
  const encode = spec.encoding ? ENCODERS[spec.encoding.kind] : null;
  // sub-blocks smaller than the kernel block: scale = F (per super-block) * I(s) (plane sub)
  const split = spec.sub_scales && { f: fold(spec.sub_scales.block, consumer).at, i: fold(spec.sub_scales.sub, consumer).at };
  const halves = split ? kernelBlock / spec.sub : 1;
  const zero = spec.encoding?.zero ?? 0;
  const interleaved = new Set(spec.interleaved);
  const valueFields = spec.value_fields.map((n) => fields[n]);
  const qBytes = spec.planes.q.bytes_per_block;
  // a scalar byte field takes a granule in the grouped layout (QuantFormat.value_width)
  const widths = Object.fromEntries(valueFields.map((f) => [f.name, spec.group > 1 && spec.fields.find((x) => x.name === f.name).count === null
    ? GRANULE : f.count * FIELD_BYTES[f.type]]));
  const record = spec.record && {
    ...spec.record,
    factors: Object.values(spec.record.factors).map((x) => ({ ...x, f: fold(x.f, consumer).at, i: x.i && fold(x.i, consumer).at })),
  };
  const view = new DataView(blocks.buffer, blocks.byteOffset, blocks.byteLength);
  const values = new Int32Array(spec.block);
  const codes = new Int32Array(kernelBlock); // a kernel block's integers minus the zero, for encode
  for (let b = 0; b < nblocks; b++) {
    const o = b * spec.stored_bytes;
    for (let i = 0; i < spec.block; i++) {
      const q = unpackAt(view, o, i);
      if (q < INT8_MIN || q > INT8_MAX) {
        throw new RangeError(`block ${b} unpacks to ${q} at element ${i}, outside int8: not a valid block of this type `
          + '(the kernels\' weights are int8)');
      }
      values[i] = q;
    }
    const z = zeroAt?.(view, o, 0);
    if (zeroAt && (z < 0 || z > 127)) {
      throw new RangeError(`block ${b} has ${spec.codes.zero.field} = ${z}, outside 0..127: not a valid block of this type `
        + '(the relaxed dot\'s 7-bit operand takes it)');
    }
    if (!encode) { // a flat block: its value fields as stored
      let at = b * qBytes;
      for (const f of valueFields) {
        const nbytes = f.count * FIELD_BYTES[f.type];
        const src = blocks.subarray(o + f.offset, o + f.offset + nbytes);
        if (interleaved.has(f.name)) splitNibbles(src, planes.q.subarray(at, at + nbytes));
        else for (let c = 0; c < widths[f.name]; c += nbytes) planes.q.set(src, at + c);
        at += widths[f.name];
      }
    }
    if (record) writeRecord(record, view, o, new DataView(planes.scale.buffer, planes.scale.byteOffset + b * record.bytes, record.bytes),
      kernelBlock / spec.sub);
    for (let s = 0; s < per; s++) {
      const k = b * per + s;
      const u = values.subarray(s * kernelBlock, (s + 1) * kernelBlock);
      if (encode) {
        for (let j = 0; j < kernelBlock; j++) codes[j] = u[j] - zero;
        encode(codes, planes.q.subarray(k * qBytes, (k + 1) * qBytes));
      }
      if (!record) {
        if (offsetAt) planes.offset[k] = offsetAt(view, o, s);
        planes.scale[k] = split ? split.f(view, o, 0) : scaleAt(view, o, s);
      }
      if (!split) continue;
      // the sub-blocks' integer scales follow the kernel block's codes in plane q (quantformat.SUB_SCALES):
      // rows one by one an i32 each holding the scale in both i16 halves, grouped an int8 twice
      const width = spec.group > 1 ? SUB_SCALE_GRANULE : 4;
      const at = new DataView(planes.q.buffer, planes.q.byteOffset + (k + 1) * qBytes - width * halves, width * halves);
      for (let h = 0; h < halves; h++) {
        const v = split.i(view, o, s * halves + h);
        if (spec.group > 1) {
          for (let c = 0; c < SUB_SCALE_GRANULE; c++) at.setInt8(width * h + c, v);
        } else {
          at.setInt16(4 * h, v, true);
          at.setInt16(4 * h + 2, v, true);
        }
      }
    }
  }
}

/** A super-block's record (quantformat.QuantFormat.record) from the stored block at byte `o` of
 * `view` into `dst`: F of each factor as f32, I as a byte per kernel block (kernel block k is
 * sub-block k * subsPerBlock). */
function writeRecord(record, view, o, dst, subsPerBlock) {
  for (const x of record.factors) {
    dst.setFloat32(x.f_at, x.f(view, o, 0), true);
    if (!x.i) continue;
    for (let k = 0; k < record.blocks; k++) {
      const v = x.i(view, o, Math.floor(k * subsPerBlock));
      if (x.signed) dst.setInt8(x.i_at + k, v);
      else dst.setUint8(x.i_at + k, v);
    }
  }
}

/** Interleaved nibbles (element 2i low, 2i+1 high) -> split nibbles (byte j holds elements j and
 * j + n), the order the kernels' two-instruction nibble unpack reads. */
function splitNibbles(src, dst) {
  const n = src.length;
  const elem = (e) => (src[e >> 1] >> (4 * (e & 1))) & 15;
  for (let j = 0; j < n; j++) dst[j] = elem(j) | (elem(j + n) << 4);
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
