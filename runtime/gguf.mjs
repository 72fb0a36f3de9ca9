// GGUF files (llama.cpp's model format) in JavaScript: the header read, and every tensor of a type
// the build supports packed for its kernels, as kernelgen/host/formats.py's load_gguf does with
// llama.cpp's own Python reader.
//
//   import { loadKernels, loadGguf } from './runtime/kernelgen.mjs';
//   const k = await loadKernels();
//   const { metadata, tensors } = await loadGguf(k, 'model-Q4_K_M.gguf');   // a URL, path, Blob or bytes
//   const y = await k.qmatvec(tensors.get('blk.0.ffn_down.weight'), await k.quantizeAct(x));
//
// The header is parsed here, not by a package: the npm reader (@huggingface/gguf) reaches its
// dependencies by bare specifiers, which a page loading runtime/ unbundled cannot resolve, and it
// parses no tensor data. tests/test_js_gguf.py checks this reader against the gguf package's on the
// same files. Only what is needed is read: the header, then each tensor's bytes (HTTP range
// requests for a URL, slices of a Blob, reads of a file in Node), two tensors in memory at a time:
// the one being packed and the next, read meanwhile.

import { halfToFloat } from './pack.mjs';
import { isNode } from './platform.mjs';

/** A file that is not GGUF, or whose header contradicts itself or its size. */
export class GgufError extends Error {
  constructor(message) {
    super(message);
    this.name = 'GgufError';
  }
}

/** GGML's tensor types (ggml.h's enum ggml_type) by name; tests/test_js_gguf.py checks every id
 * against the gguf package's GGMLQuantizationType. */
export const GGML_TYPES = Object.freeze({
  F32: 0, F16: 1, Q4_0: 2, Q4_1: 3, Q5_0: 6, Q5_1: 7, Q8_0: 8, Q8_1: 9, Q2_K: 10, Q3_K: 11, Q4_K: 12,
  Q5_K: 13, Q6_K: 14, Q8_K: 15, IQ2_XXS: 16, IQ2_XS: 17, IQ3_XXS: 18, IQ1_S: 19, IQ4_NL: 20, IQ3_S: 21,
  IQ2_S: 22, IQ4_XS: 23, I8: 24, I16: 25, I32: 26, I64: 27, F64: 28, IQ1_M: 29, BF16: 30, TQ1_0: 34,
  TQ2_0: 35, MXFP4: 39, NVFP4: 40, Q1_0: 41,
});
const TYPE_NAMES = new Map(Object.entries(GGML_TYPES).map(([name, id]) => [id, name]));
const FLOATS = { F32: 4, F16: 2, BF16: 2 }; // float tensors come back as Float32Array: bytes per stored value

const MAGIC = 0x46554747; // "GGUF", read as a little-endian u32
const VERSIONS = [2, 3]; // version 1 had 32-bit counts; llama.cpp reads 2 and 3
const DEFAULT_ALIGNMENT = 32;
const MAX_DIMS = 4; // GGML_MAX_DIMS
const MAX_ARRAY_DEPTH = 8; // arrays of arrays: deeper ones are refused, not recursed into
const FIRST_READ = 1 << 20; // bytes of header read at first; more as the header needs

// Metadata value types (gguf's GGUFValueType): [name, bytes, read(view, at)]; strings and arrays
// are read by Header.value. 64-bit integers come back as BigInt.
const SCALARS = new Map([
  [0, ['u8', 1, (v, o) => v.getUint8(o), Uint8Array]],
  [1, ['i8', 1, (v, o) => v.getInt8(o), Int8Array]],
  [2, ['u16', 2, (v, o) => v.getUint16(o, true), Uint16Array]],
  [3, ['i16', 2, (v, o) => v.getInt16(o, true), Int16Array]],
  [4, ['u32', 4, (v, o) => v.getUint32(o, true), Uint32Array]],
  [5, ['i32', 4, (v, o) => v.getInt32(o, true), Int32Array]],
  [6, ['f32', 4, (v, o) => v.getFloat32(o, true), Float32Array]],
  [7, ['bool', 1, (v, o) => v.getUint8(o), null]],
  [10, ['u64', 8, (v, o) => v.getBigUint64(o, true), BigUint64Array]],
  [11, ['i64', 8, (v, o) => v.getBigInt64(o, true), BigInt64Array]],
  [12, ['f64', 8, (v, o) => v.getFloat64(o, true), Float64Array]],
]);
const U32 = 4;
const STRING = 8;
const ARRAY = 9;
const MIN_BYTES = { [STRING]: 8, [ARRAY]: 12 }; // an empty string's length; an empty array's type and count
const UTF8 = new TextDecoder('utf-8');
const UTF8_EXACT = new TextDecoder('utf-8', { fatal: true });

// ---- where the bytes come from -------------------------------------------------------------------

/** {label, size, read(offset, length) -> Uint8Array, close()} over bytes, a Blob, a file (Node) or
 * a URL (HTTP range requests; the whole body once when the server sends it whole). read gives an
 * array on a buffer of its own: pack() on a page posts it to the driver worker, and a posted view
 * takes its whole buffer along (a slice of a 4 GB file's bytes would copy the 4 GB). */
async function openSource(what, source, signal) {
  if (source instanceof ArrayBuffer || ArrayBuffer.isView(source)) {
    const bytes = source instanceof ArrayBuffer ? new Uint8Array(source)
      : new Uint8Array(source.buffer, source.byteOffset, source.byteLength);
    return inMemory('bytes', bytes);
  }
  if (typeof Blob === 'function' && source instanceof Blob) {
    const label = typeof source.name === 'string' && source.name ? source.name : 'blob';
    return { label, size: source.size, read: async (at, n) => new Uint8Array(await source.slice(at, at + n).arrayBuffer()), close() {} };
  }
  if (typeof source !== 'string' && !(source instanceof URL)) {
    throw new TypeError(`${what}: source must be a URL, a path or URL string, a Blob, an ArrayBuffer or a typed array`);
  }
  const url = await toUrl(source);
  if (isNode && url.protocol === 'file:') return openFile(url);
  return openUrl(url, signal);
}

function inMemory(label, bytes) {
  return { label, size: bytes.length, read: async (at, n) => bytes.slice(at, at + n), close() {} };
}

async function toUrl(source) {
  if (source instanceof URL) return source;
  if (isNode && !/^[a-z][a-z0-9+.-]*:\/\//i.test(source)) { // a path: relative to the working directory
    const [{ pathToFileURL }, { resolve }] = await Promise.all([import('node:url'), import('node:path')]);
    return pathToFileURL(resolve(source));
  }
  return new URL(source, globalThis.location?.href);
}

async function openFile(url) {
  const { open } = await import('node:fs/promises');
  const { fileURLToPath } = await import('node:url');
  const label = fileURLToPath(url);
  const handle = await open(url, 'r');
  try {
    const stat = await handle.stat();
    if (!stat.isFile()) throw new GgufError(`${label}: not a file (a GGUF file is read from a regular file)`);
    const { size } = stat;
    const read = async (at, n) => {
      const out = new Uint8Array(n);
      for (let got = 0; got < n;) {
        const { bytesRead } = await handle.read(out, got, n - got, at + got);
        if (bytesRead === 0) throw new GgufError(`${label}: the file ended at ${at + got} bytes while reading ${n} from ${at}`);
        got += bytesRead;
      }
      return out;
    };
    return { label, size, read, close: () => handle.close() };
  } catch (e) {
    await handle.close();
    throw e;
  }
}

/** close() aborts what is still downloading (a read ahead that a failed load left behind), so a
 * failure costs no more of the user's bandwidth than the bytes already on their way. */
async function openUrl(url, signal) {
  const label = url.href;
  const own = new AbortController(); // the caller's signal, or close()
  const follow = () => own.abort(signal.reason);
  if (signal?.aborted) follow();
  signal?.addEventListener('abort', follow, { once: true });
  const close = () => {
    signal?.removeEventListener('abort', follow);
    own.abort(new GgufError(`${label}: closed`));
  };
  const get = async (at, n) => {
    const res = await fetch(url, { headers: { Range: `bytes=${at}-${at + n - 1}` }, signal: own.signal });
    if (res.status !== 206 && res.status !== 200) throw new GgufError(`${label}: HTTP ${res.status}`);
    return res;
  };
  try {
    const first = await get(0, FIRST_READ);
    if (first.status === 200) { // no ranges: all of it
      const bytes = new Uint8Array(await first.arrayBuffer());
      close();
      return inMemory(label, bytes);
    }
    const total = /\/(\d+)$/.exec(first.headers.get('Content-Range') ?? '');
    if (!total) throw new GgufError(`${label}: the server answered a range request without the file's size (Content-Range)`);
    const size = Number(total[1]);
    const head = new Uint8Array(await first.arrayBuffer());
    const read = async (at, n) => {
      if (at + n <= head.length) return head.slice(at, at + n);
      const bytes = new Uint8Array(await (await get(at, n)).arrayBuffer());
      if (bytes.length !== n) throw new GgufError(`${label}: asked for ${n} bytes at ${at}, got ${bytes.length}`);
      return bytes;
    };
    return { label, size, read, close };
  } catch (e) {
    close();
    throw e;
  }
}

// ---- the header ---------------------------------------------------------------------------------

/** A little-endian cursor over the header, reading more of the source as it goes. Every count and
 * length is checked against the bytes left in the file before anything is allocated for it. */
class Header {
  constructor(src) {
    this.src = src;
    this.bytes = new Uint8Array(0);
    this.view = new DataView(this.bytes.buffer);
    this.pos = 0;
  }

  fail(message) {
    return new GgufError(`${this.src.label}: not a readable GGUF file (${message})`);
  }

  get left() {
    return this.src.size - this.pos;
  }

  /** Make bytes pos .. pos + n - 1 readable. */
  async need(n, what) {
    if (n > this.left) throw this.fail(`${what} needs ${n} bytes at offset ${this.pos}, and the file has ${this.left} left`);
    if (this.pos + n <= this.bytes.length) return;
    const want = Math.min(this.src.size, Math.max(this.pos + n, 2 * this.bytes.length, FIRST_READ));
    const more = await this.src.read(this.bytes.length, want - this.bytes.length);
    const bytes = new Uint8Array(want);
    bytes.set(this.bytes);
    bytes.set(more, this.bytes.length);
    this.bytes = bytes;
    this.view = new DataView(bytes.buffer);
  }

  async scalar(type, what) {
    const [, n, get] = SCALARS.get(type);
    await this.need(n, what);
    const v = get(this.view, this.pos);
    this.pos += n;
    return type === 7 ? v !== 0 : v;
  }

  async u32(what) { return this.scalar(4, what); }

  /** A u64 count that must fit in `most`. */
  async count(what, most) {
    const n = await this.scalar(10, what);
    if (n > BigInt(most)) throw this.fail(`${what} is ${n}, more than the ${most} the rest of the file could hold`);
    return Number(n);
  }

  /** A string; `exact`: invalid UTF-8 is an error (keys and names), else replaced (values). */
  async string(what, exact) {
    const n = await this.count(`${what}'s length`, this.left - 8);
    await this.need(n, what);
    const bytes = this.bytes.subarray(this.pos, this.pos + n);
    this.pos += n;
    try {
      return (exact ? UTF8_EXACT : UTF8).decode(bytes);
    } catch {
      throw this.fail(`${what} is not UTF-8`);
    }
  }

  /** The next string if it is buffered (a value: invalid UTF-8 replaced), else undefined: an
   * array of 10^5 tokens reads without a promise per token. */
  bufferedString() {
    if (this.pos + 8 > this.bytes.length) return undefined;
    const n = this.view.getBigUint64(this.pos, true);
    if (n > BigInt(this.bytes.length - this.pos - 8)) return undefined;
    const start = this.pos + 8;
    this.pos = start + Number(n);
    return UTF8.decode(this.bytes.subarray(start, this.pos));
  }

  async value(type, what, depth) {
    if (SCALARS.has(type)) return this.scalar(type, what);
    if (type === STRING) return this.string(what, false);
    if (type !== ARRAY) throw this.fail(`${what} has value type ${type}, which GGUF does not define`);
    if (depth >= MAX_ARRAY_DEPTH) throw this.fail(`${what} nests arrays more than ${MAX_ARRAY_DEPTH} deep`);
    const elem = await this.u32(`${what}'s element type`);
    const size = SCALARS.get(elem)?.[1] ?? MIN_BYTES[elem];
    if (size === undefined) throw this.fail(`${what} has element type ${elem}, which GGUF does not define`);
    const n = await this.count(`${what}'s length`, Math.floor((this.left - 8) / size));
    const Typed = SCALARS.get(elem)?.[3];
    if (Typed) { // numbers: one typed array (a vocabulary's scores are 10^5 of them)
      await this.need(n * size, what);
      const out = new Typed(n);
      new Uint8Array(out.buffer).set(this.bytes.subarray(this.pos, this.pos + n * size));
      this.pos += n * size;
      return out;
    }
    const out = [];
    for (let i = 0; i < n; i++) out.push((elem === STRING ? this.bufferedString() : undefined) ?? await this.value(elem, `${what}[${i}]`, depth + 1));
    return out;
  }
}

/** Byte size of a tensor of dimensions `dims` (GGML's order) stored as `type`, for the float types
 * and the types `quants` (a manifest's) declares; null when its rows are not whole blocks. */
function tensorBytes(type, dims, quants) {
  if (type in FLOATS) return dims.reduce((a, b) => a * b, 1) * FLOATS[type];
  const spec = quants[type.toLowerCase()];
  if (!spec || dims[0] % spec.block) return null;
  return dims.reduce((a, b) => a * b, 1) / spec.block * spec.stored_bytes;
}

/**
 * Read a GGUF file's header: {label, version, alignment, metadata, tensors} with metadata a
 * Map of key -> value (numbers, BigInt for 64-bit integers, strings, booleans, typed arrays for
 * arrays of numbers, arrays otherwise) and tensors [{name, type, dims, offset}] in file order (type
 * GGML's name, or `unknown(id)`; dims in GGML's order, the row length first; offset absolute).
 * A malformed header is a GgufError before anything is read past it.
 */
async function readHeader(src) {
  const h = new Header(src);
  if (await h.u32('the magic') !== MAGIC) throw h.fail('it does not start with "GGUF"');
  const version = await h.u32('the version');
  if (!VERSIONS.includes(version)) {
    const swapped = ((version & 0xff) << 24 | (version & 0xff00) << 8 | (version >>> 8) & 0xff00 | version >>> 24) >>> 0;
    throw h.fail(VERSIONS.includes(swapped) ? 'a big-endian file: only little-endian GGUF is read'
      : `version ${version}; versions ${VERSIONS.join(' and ')} are read`);
  }
  const ntensors = await h.count('the tensor count', Math.floor(h.left / 32)); // a tensor's entry takes >= 32 bytes
  const nkv = await h.count('the metadata count', Math.floor(h.left / 13)); // a key-value pair takes >= 13
  const metadata = new Map();
  for (let i = 0; i < nkv; i++) {
    const key = await h.string(`metadata key ${i}`, true);
    if (metadata.has(key)) throw h.fail(`metadata key ${JSON.stringify(key)} appears twice`);
    const type = await h.u32(`metadata ${key}'s type`);
    if (key === 'general.alignment' && type !== U32) { // (as llama.cpp's reader: a number of another type is refused)
      throw h.fail(`general.alignment has value type ${SCALARS.get(type)?.[0] ?? type}, not u32`);
    }
    metadata.set(key, await h.value(type, `metadata ${key}`, 0));
  }
  let alignment = DEFAULT_ALIGNMENT;
  if (metadata.has('general.alignment')) {
    alignment = metadata.get('general.alignment');
    if (alignment === 0 || (alignment & (alignment - 1)) !== 0) throw h.fail(`general.alignment is ${alignment}, not a power of two`);
  }
  const infos = [];
  const names = new Set();
  for (let i = 0; i < ntensors; i++) {
    const name = await h.string(`tensor ${i}'s name`, true);
    if (names.has(name)) throw h.fail(`tensor ${JSON.stringify(name)} appears twice`);
    names.add(name);
    const ndims = await h.u32(`tensor ${name}'s dimension count`);
    if (ndims < 1 || ndims > MAX_DIMS) throw h.fail(`tensor ${name} has ${ndims} dimensions, not 1 to ${MAX_DIMS}`);
    const dims = [];
    for (let d = 0; d < ndims; d++) dims.push(await h.count(`tensor ${name}'s dimension ${d}`, Number.MAX_SAFE_INTEGER));
    if (dims.some((d) => d < 1) || dims.reduce((a, b) => a * b, 1) > Number.MAX_SAFE_INTEGER) {
      throw h.fail(`tensor ${name} has dimensions [${dims.join(', ')}]`);
    }
    const id = await h.u32(`tensor ${name}'s type`);
    const type = TYPE_NAMES.get(id) ?? `unknown(${id})`;
    const offset = await h.count(`tensor ${name}'s offset`, Number.MAX_SAFE_INTEGER);
    if (offset % alignment) throw h.fail(`tensor ${name}'s data offset ${offset} is not a multiple of the alignment ${alignment}`);
    infos.push({ name, type, dims, offset });
  }
  const data = Math.ceil(h.pos / alignment) * alignment;
  const tensors = infos.map((t) => ({ ...t, offset: data + t.offset }));
  return { label: src.label, version, alignment, metadata, tensors };
}

/**
 * A GGUF file's header without its tensors' data: {version, alignment, metadata, tensors} (see
 * loadGguf; tensors as [{name, type, dims, offset}], dims in GGML's order). What a page shows
 * before loading, or how it picks a build: the quant types the file holds.
 */
export async function readGgufInfo(source, opts) {
  if (opts !== undefined && (opts === null || typeof opts !== 'object')) throw new TypeError('readGgufInfo: options must be an object');
  const src = await openSource('readGgufInfo', source, opts?.signal);
  try {
    const { label, ...info } = await readHeader(src);
    return info;
  } finally {
    await src.close();
  }
}

// ---- packing ------------------------------------------------------------------------------------

/**
 * Every tensor of a GGUF file by name, quantized ones packed into `kernels`' memory:
 * {version, metadata, tensors}, tensors a Map of name -> Packed (pack() of the tensor's blocks:
 * rows the product of its outer dimensions, k its row length) or, for F32, F16 and BF16 tensors,
 * {type, shape, data}: shape in numpy's order (the row length last, as formats.load_gguf gives it)
 * and data a Float32Array (F16 and BF16 widened, exactly).
 *
 * A tensor of a type the build does not declare (a GGML type is supported when the build declares a
 * quant type of its name in lower case: Q4_K -> q4_k) is a GgufError naming it, its type and the
 * supported types, before anything is packed. A tensor whose data lies outside the file, or overlaps
 * another's, is one too. If reading or packing fails part way, what was packed is freed: nothing is
 * half-loaded. `source`: a URL or URL string (HTTP range requests; a path in Node), a Blob (a File a
 * user picked), an ArrayBuffer or a typed array of the file's bytes. Options: `signal` (an
 * AbortSignal) cancels the load; `onProgress({tensor, done, tensors, bytes, totalBytes})` is called
 * after each tensor (the bytes of tensor data read so far; an error it throws ends the load).
 */
export async function loadGguf(kernels, source, opts) {
  const quants = kernels?.manifest?.quants;
  if (typeof kernels?.pack !== 'function' || typeof kernels?.free !== 'function' || !quants || typeof quants !== 'object') {
    throw new TypeError('loadGguf: kernels must come from loadKernels()');
  }
  if (opts !== undefined && (opts === null || typeof opts !== 'object')) throw new TypeError('loadGguf: options must be an object');
  const { signal, onProgress } = opts ?? {};
  if (signal !== undefined && !(signal instanceof AbortSignal)) throw new TypeError('loadGguf: signal must be an AbortSignal');
  if (onProgress !== undefined && typeof onProgress !== 'function') throw new TypeError('loadGguf: onProgress must be a function');
  const src = await openSource('loadGguf', source, signal);
  const packed = [];
  try {
    const header = await readHeader(src);
    // the floats first, then the declared types in GGML's order (as formats.load_gguf lists them)
    const supported = [...Object.keys(FLOATS), ...[...TYPE_NAMES.values()].filter((t) => !(t in FLOATS) && Object.hasOwn(quants, t.toLowerCase()))];
    const sized = header.tensors.map((t) => {
      if (!supported.includes(t.type)) {
        throw new GgufError(`${src.label}: tensor ${JSON.stringify(t.name)} has type ${t.type}, which this build does not `
          + `support (supported: ${supported.join(', ')})`);
      }
      const bytes = tensorBytes(t.type, t.dims, quants);
      if (bytes === null) {
        throw new GgufError(`${src.label}: tensor ${JSON.stringify(t.name)} (${t.type}) has rows of ${t.dims[0]} values, `
          + `not whole blocks of ${quants[t.type.toLowerCase()].block}`);
      }
      if (t.offset + bytes > src.size) {
        throw new GgufError(`${src.label}: tensor ${JSON.stringify(t.name)}'s ${bytes} bytes at ${t.offset} lie past the end `
          + `of the file (${src.size} bytes)`);
      }
      return { ...t, bytes };
    });
    const byOffset = [...sized].sort((a, b) => a.offset - b.offset);
    for (let i = 1; i < byOffset.length; i++) {
      const [a, b] = [byOffset[i - 1], byOffset[i]];
      if (a.offset + a.bytes > b.offset) throw new GgufError(`${src.label}: tensors ${JSON.stringify(a.name)} and ${JSON.stringify(b.name)} overlap`);
    }
    const tensors = new Map();
    const progress = { tensor: null, done: 0, tensors: sized.length, bytes: 0, totalBytes: sized.reduce((n, t) => n + t.bytes, 0) };
    // one read ahead: tensor i + 1 arrives while tensor i is packed (on a page, in the driver worker),
    // so the download and the packing overlap instead of taking turns
    const read = (t) => {
      const bytes = src.read(t.offset, t.bytes);
      bytes.catch(() => {}); // a read left behind by a failure: its rejection is not the load's error
      return bytes;
    };
    let next = sized.length ? read(sized[0]) : null;
    for (const [i, t] of sized.entries()) {
      signal?.throwIfAborted();
      const bytes = await next;
      next = i + 1 < sized.length ? read(sized[i + 1]) : null;
      if (t.type in FLOATS) {
        tensors.set(t.name, { type: t.type, shape: [...t.dims].reverse(), data: floats(t.type, bytes) });
      } else {
        const k = t.dims[0];
        const w = await kernels.pack(t.type.toLowerCase(), bytes, t.dims.reduce((a, b) => a * b, 1) / k, k);
        packed.push(w);
        tensors.set(t.name, w);
      }
      Object.assign(progress, { tensor: t.name, done: progress.done + 1, bytes: progress.bytes + t.bytes });
      onProgress?.({ ...progress });
    }
    return { version: header.version, metadata: header.metadata, tensors };
  } catch (e) {
    for (const w of packed) {
      try {
        await kernels.free(w);
      } catch { // the kernels were terminated during the load (the likely cause of e, which says more)
      }
    }
    throw e;
  } finally {
    await src.close();
  }
}

const LITTLE_ENDIAN = new Uint8Array(Uint16Array.of(1).buffer)[0] === 1;

/** A float tensor's little-endian bytes (an array on a buffer of its own, as src.read gives) as a
 * Float32Array: F32 copied, F16 and BF16 widened exactly (a bfloat16 is the top half of a float32). */
function floats(type, bytes) {
  const n = bytes.byteLength / FLOATS[type];
  const view = new DataView(bytes.buffer, bytes.byteOffset, bytes.byteLength);
  if (type === 'F32') {
    if (LITTLE_ENDIAN && bytes.byteOffset % 4 === 0) return new Float32Array(bytes.buffer, bytes.byteOffset, n);
    return Float32Array.from({ length: n }, (_, i) => view.getFloat32(4 * i, true));
  }
  const out = new Float32Array(n);
  if (type === 'BF16') {
    const bits = new Uint32Array(out.buffer);
    for (let i = 0; i < n; i++) bits[i] = view.getUint16(2 * i, true) << 16;
  } else {
    for (let i = 0; i < n; i++) out[i] = halfToFloat(view.getUint16(2 * i, true));
  }
  return out;
}
