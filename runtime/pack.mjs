// Packing stored quant blocks into the planes the kernels read, from the manifest alone.
//
// Mirrors QuantFormat.pack in kernelgen/quantformat.py: the manifest's "quants" entry of a type gives its
// fields, value fields, interleaved fields and its formulas as JSON trees, so any declared type
// packs here without code of its own. Planes (each contiguous, row-major, one entry per block):
//   q       the value fields' bytes, concatenated in "value_fields" order ("interleaved" nibble
//           fields repacked from ONNX order, element 2i low / 2i+1 high, to split order)
//   scale   f32: the "scale" formula (f16 fields widened)
//   offset  f32: the "offset" formula, only for types that have one
//   sum     i32: the sum of the block's unpacked integers (removes the relaxed dot's +ACT_ZERO)

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

/** IEEE binary16 bits -> the number (exact: every half is a float32). */
export function halfToFloat(h) {
  const sign = h & 0x8000 ? -1 : 1;
  const exp = (h >> 10) & 0x1f;
  const frac = h & 0x3ff;
  if (exp === 0) return sign * frac * 2 ** -24;
  if (exp === 0x1f) return frac ? NaN : sign * Infinity;
  return sign * (1024 + frac) * 2 ** (exp - 25);
}

// ---- formulas ----------------------------------------------------------------------------------
// A formula is the manifest's JSON tree (kernelgen/quantformat.py: {kind, attributes, args}). One
// walker, `fold`, calls a consumer's method for the node's kind with its children's results; the two
// consumers below turn a tree into a function of a block read through a DataView `v` at byte
// offset `o` (the block's first byte) and, for unpack, the element index `i`.

function fold(tree, consumer) {
  const visit = consumer[tree.kind];
  if (!visit) throw new Error(`formula: no ${tree.kind} node here`);
  return visit(tree, ...(tree.args ?? []).map((t) => fold(t, consumer)));
}

const INT_OPS = {
  '+': (a, b) => (a + b) | 0,
  '-': (a, b) => (a - b) | 0,
  '&': (a, b) => a & b,
  '|': (a, b) => a | b,
  '<<': (a, b) => a << b,
};

/** Unpack: (v, o, i) => int32, evaluated in int32 as numpy does in quantformat.py. */
const unpackConsumer = (fields) => ({
  int: (t) => () => t.value | 0,
  field: (t) => {
    const f = fields[t.field];
    const read = FIELD_READERS[f.type];
    return (v, o) => read(v, o + f.offset);
  },
  index: (t) => {
    const f = fields[t.field];
    const read = FIELD_READERS[f.type];
    return (v, o, i) => read(v, o + f.offset + i);
  },
  call: (t) => {
    const f = fields[t.field];
    const n = f.count;
    switch (t.func) {
      // nib: element i is the low nibble of byte i for i < n, else the high nibble of byte i - n
      case 'nib': return (v, o, i) => (i < n ? v.getUint8(o + f.offset + i) & 15 : v.getUint8(o + f.offset + i - n) >> 4);
      // nibi: element i is nibble i & 1 of byte i >> 1 (ONNX UINT4)
      case 'nibi': return (v, o, i) => (v.getUint8(o + f.offset + (i >> 1)) >> (4 * (i & 1))) & 15;
      // bit: bit i of the little-endian mask
      case 'bit': return (v, o, i) => (v.getUint8(o + f.offset + (i >> 3)) >> (i & 7)) & 1;
      default: throw new Error(`unpack: unknown function ${t.func}`);
    }
  },
  lookup: (t, code) => (v, o, i) => t.values[code(v, o, i)],
  op: (t, a, b) => {
    const op = INT_OPS[t.op];
    if (!op) throw new Error(`unpack: unknown operator ${t.op}`);
    return (v, o, i) => op(a(v, o, i), b(v, o, i));
  },
});

const r = Math.fround;
const FLOAT_OPS = { '+': (a, b) => r(a + b), '-': (a, b) => r(a - b), '*': (a, b) => r(a * b), '/': (a, b) => r(a / b) };

/** Scale or offset: (v, o) => float32, rounding after every operation as numpy's float32
 * arithmetic does (one double operation rounded once to float32 is exact for + - * /). */
const scalarConsumer = (fields) => ({
  int: (t) => () => r(t.value),
  float: (t) => () => r(t.value),
  field: (t) => {
    const f = fields[t.field];
    const read = FIELD_READERS[f.type];
    return (v, o) => r(read(v, o + f.offset));
  },
  neg: (t, a) => (v, o) => -a(v, o),
  pow2: (t, a) => (v, o) => r(2 ** a(v, o)),
  op: (t, a, b) => {
    const op = FLOAT_OPS[t.op];
    if (!op) throw new Error(`scale/offset: unknown operator ${t.op}`);
    return (v, o) => op(a(v, o), b(v, o));
  },
});

// ---- packing -----------------------------------------------------------------------------------

/** Plane name -> {Array: typed array constructor, perBlock: elements per block}, in the order the
 * kernels take the planes as arguments. */
export function planeLayout(spec) {
  const out = {};
  for (const [name, p] of Object.entries(spec.planes)) {
    const Array = PLANE_ARRAYS[p.dtype];
    if (!Array) throw new Error(`plane ${name}: unsupported dtype ${p.dtype}`);
    out[name] = { Array, perBlock: p.bytes_per_block / Array.BYTES_PER_ELEMENT };
  }
  return out;
}

/**
 * Pack `nblocks` stored blocks (bytes, `spec.stored_bytes` each) into `planes`, typed arrays of
 * planeLayout(spec)'s types with room for `nblocks` blocks each (e.g. views of wasm memory).
 */
export function packInto(spec, blocks, nblocks, planes) {
  const fields = Object.fromEntries(spec.fields.map((f) => [f.name, { ...f, count: f.count ?? 1 }]));
  const { unpack, scale, offset } = spec.formulas;
  const unpackAt = fold(unpack, unpackConsumer(fields));
  const scaleAt = fold(scale, scalarConsumer(fields));
  const offsetAt = offset ? fold(offset, scalarConsumer(fields)) : null;
  const interleaved = new Set(spec.interleaved);
  const valueFields = spec.value_fields.map((n) => fields[n]);
  const qBytes = spec.planes.q.bytes_per_block;
  const view = new DataView(blocks.buffer, blocks.byteOffset, blocks.byteLength);
  for (let b = 0; b < nblocks; b++) {
    const o = b * spec.stored_bytes;
    let at = b * qBytes;
    for (const f of valueFields) {
      const nbytes = f.count * FIELD_BYTES[f.type];
      const src = blocks.subarray(o + f.offset, o + f.offset + nbytes);
      if (interleaved.has(f.name)) splitNibbles(src, planes.q.subarray(at, at + nbytes));
      else planes.q.set(src, at);
      at += nbytes;
    }
    planes.scale[b] = scaleAt(view, o);
    if (offsetAt) planes.offset[b] = offsetAt(view, o);
    let sum = 0;
    for (let i = 0; i < spec.block; i++) {
      const q = unpackAt(view, o, i);
      if (q < INT8_MIN || q > INT8_MAX) {
        throw new RangeError(`block ${b} unpacks to ${q} at element ${i}, outside int8: not a valid block of this type `
          + '(the kernels\' weights are int8)');
      }
      sum += q;
    }
    planes.sum[b] = sum;
  }
}

/** Interleaved nibbles (element 2i low, 2i+1 high) -> split nibbles (byte j holds elements j and
 * j + n), the order the kernels' two-instruction nibble unpack reads. */
function splitNibbles(src, dst) {
  const n = src.length;
  const elem = (e) => (src[e >> 1] >> (4 * (e & 1))) & 15;
  for (let j = 0; j < n; j++) dst[j] = elem(j) | (elem(j + n) << 4);
}

/** Pack into fresh typed arrays: {q, scale, offset?, sum}. */
export function packPlanes(spec, blocks, nblocks) {
  const planes = {};
  for (const [name, { Array, perBlock }] of Object.entries(planeLayout(spec))) {
    planes[name] = new Array(perBlock * nblocks);
  }
  packInto(spec, blocks, nblocks, planes);
  return planes;
}
