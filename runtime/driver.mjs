// The driver: one built target's module, its shared memory and pool, and the kernels over typed
// arrays. It runs where blocking is allowed: Node's main thread, or the driver worker in a browser
// (runtime/worker.mjs), and mirrors kernelgen/host/api.py: inputs are copied into the module's memory,
// per-call buffers are freed when the call returns, packed weights at free(packed) or reset().

import { probeRelaxedDot, sharedMemoryStatus } from './features.mjs';
import { I32_MAX, MAX_THREADS, checkArguments, checkExports, loadBuild } from './manifest.mjs';
import { byteLengthOf, checkBlocks, classOf, lengthOf, packInto, paddedRows, planeLayout, typedArray } from './pack.mjs';
import { hardwareThreads, isNode } from './platform.mjs';
import { POOL_EXPORTS, Pool } from './pool.mjs';

const PAGE_BYTES = 65536;
const ACT_BLOCK = 32; // quantize_act: one scale per 32 values (kernels.dsl)
const ACT_ARRAYS = { int8: Int8Array, uint8: Uint8Array, int16: Int16Array, int32: Int32Array }; // manifest activation.dtype, .sums
const VECTOR_BYTES = 16; // zero bytes after each array copied in or held: a margin (no kernel reads past its extent)
const LANES = 4; // f32 lanes per vector: softmax rows are padded to a multiple of it
const TARGETS = ['relaxed-simd', 'simd128'];

/** Methods the facade (runtime/kernelgen.mjs) may call, here or through the driver worker. */
export const API = ['quantizeAct', 'pack', 'qdot', 'qmatvec', 'qmatmul', 'dotF32', 'matvecF32', 'matmulF32', 'exp',
  'softmax', 'rope', 'ropeTable', 'silu', 'swiglu', 'erf', 'gelu', 'addBias', 'linear', 'layerNorm', 'attention',
  'meanPool', 'l2Normalize', 'hold', 'read', 'run', 'setThreads', 'runJob', 'free', 'reset', 'bench'];

const f32Array = (what, x) => typedArray(what, x, Float32Array);

// What run() takes for a scalar parameter of each wasm type: the call would otherwise coerce a
// string, NaN or an object to 0 (and wrap 2^32 + 4 to 4) without a word.
const SCALARS = { i32: 'a 32-bit integer', i64: 'a BigInt within 64 bits', f32: 'a number', f64: 'a number' };
function scalarFits(type, v) {
  if (type === 'i32') return Number.isInteger(v) && v >= -(2 ** 31) && v < 2 ** 32;
  if (type === 'i64') return typeof v === 'bigint' && v >= -(2n ** 63n) && v < 2n ** 64n;
  return typeof v === 'number';
}

/** An optional yes/no option: undefined or a boolean (a string such as "no" would count as true). */
function flag(what, v) {
  if (v !== undefined && typeof v !== 'boolean') throw new TypeError(`${what}: expected true or false, got ${typeof v} ${String(v)}`);
}

/** opts as an object ({} for undefined or null), else a TypeError. */
function options(what, opts) {
  if (opts === undefined || opts === null) return {};
  if (typeof opts !== 'object' || Array.isArray(opts)) throw new TypeError(`${what}: options must be an object, got ${typeof opts}`);
  return opts;
}

/** A held array (Driver.hold, or a kernel's result with {hold: true}): its memory stays in the module. */
const isHeld = (x) => x?.held === true;

/** x if it is a Float32Array or a held array (checked where its address is taken), else a TypeError. */
function f32Input(what, x) {
  return isHeld(x) ? x : f32Array(what, x);
}

function positiveInt(what, n) {
  if (typeof n !== 'number') throw new TypeError(`${what}: expected an integer (a number), got ${typeof n} ${String(n)}`);
  if (!Number.isInteger(n) || n < 1 || n > I32_MAX) throw new RangeError(`${what}: expected an integer in 1..${I32_MAX}, got ${n}`);
  return n;
}

/** A manifest no one can edit: the driver's checks read it (activation.max, memory.heap_base), and
 * Node hands the driver's own object out as Kernels.manifest. */
export function deepFreeze(v) {
  if (v !== null && typeof v === 'object' && !Object.isFrozen(v)) {
    Object.freeze(v);
    Object.values(v).forEach(deepFreeze);
  }
  return v;
}

// Names this driver's Packed handles: a handle from another driver (another target, another load)
// is refused. A string, not identity, since handles are cloned through postMessage in browsers.
const driverId = () => `${Date.now().toString(36)}-${Math.random().toString(36).slice(2)}`;

/** Which target to load: the one asked for, else relaxed SIMD where its dot is usable. */
function chooseTarget(requested, relaxed) {
  if (requested !== undefined && !TARGETS.includes(requested)) {
    throw new RangeError(`target must be one of ${TARGETS.join(', ')}, got ${requested}`);
  }
  if (requested === 'relaxed-simd' && !relaxed.usable) throw new Error(`relaxed-simd requested, but ${relaxed.note}`);
  if (requested) return { target: requested, why: 'requested' };
  return relaxed.usable
    ? { target: 'relaxed-simd', why: 'relaxed SIMD is available and its dot is exact in the 7-bit contract' }
    : { target: 'simd128', why: relaxed.note };
}

/**
 * Which build of the target to run: a flavor (manifest.flavors: the same kernels and results, ops
 * in forms faster where the engine lowers the relaxed dot as its `when` says) or the base build.
 * `requested`: 'auto' (undefined: the first flavor whose `when` the probe matches), 'base' or a
 * flavor's name. Returns {flavor: its name or null for the base, dir, why}.
 */
export function chooseFlavor(manifest, requested, relaxed) {
  const flavors = manifest.flavors ?? {};
  if (requested !== undefined && typeof requested !== 'string') {
    throw new TypeError(`flavor must be 'auto', 'base' or a flavor's name, got ${typeof requested}`);
  }
  if (requested === undefined || requested === 'auto') {
    const match = Object.entries(flavors).find(([, f]) => Object.entries(f.when).every(([k, v]) => relaxed[k] === v));
    return match
      ? { flavor: match[0], dir: match[1].dir, why: match[1].why ?? `the probe found ${JSON.stringify(match[1].when)}` }
      : { flavor: null, dir: null, why: 'no flavor of this build suits the probe of the relaxed dot' };
  }
  if (requested === 'base') return { flavor: null, dir: null, why: 'requested' };
  if (!Object.hasOwn(flavors, requested)) {
    const have = Object.keys(flavors).join(', ') || 'it has none';
    throw new RangeError(`flavor must be 'auto', 'base' or one of this build's flavors (${have}), got ${requested}`);
  }
  return { flavor: requested, dir: flavors[requested].dir, why: 'requested' };
}

export class Driver {
  /**
   * Load `baseUrl`/<target>/kernels.{json,wasm} (baseUrl: the build's out/ directory as a URL), or
   * its `flavor`'s build in the directory the manifest names (chooseFlavor), and start a pool of
   * `threads` threads. `stopFlag`: an Int32Array[1] on a SharedArrayBuffer whose nonzero value ends
   * a bench loop (or null).
   */
  static async load({ baseUrl, target, flavor, threads, stopFlag = null }) {
    const relaxed = await probeRelaxedDot();
    const chosen = chooseTarget(target, relaxed);
    const dir = new URL(`${chosen.target}/`, baseUrl);
    let { manifest, wasm, notes } = await loadBuild(dir);
    if (manifest.target !== chosen.target) {
      throw new Error(`${new URL('kernels.json', dir)}: a build for target ${manifest.target}, not ${chosen.target}; rebuild with \`kernelgen build\``);
    }
    let flavored = chooseFlavor(manifest, flavor, relaxed);
    if (flavored.flavor !== null) {
      try {
        const build = await loadBuild(new URL(`${flavored.dir}/`, dir));
        if (build.manifest.flavor !== flavored.flavor || build.manifest.target !== chosen.target) {
          const where = new URL(`${flavored.dir}/kernels.json`, dir);
          throw new Error(`${where}: not the ${flavored.flavor} flavor's manifest`);
        }
        ({ manifest, wasm, notes } = build);
      } catch (e) {
        // a flavor chosen by the probe but not deployed beside its base: the base build gives the same results
        if (!(e.unreadable && (flavor === undefined || flavor === 'auto'))) throw e;
        const name = flavored.flavor;
        notes.push(`the ${name} flavor suits this engine, but ${e.message.split(';')[0]}: running the base build`);
        flavored = { flavor: null, dir: null, why: `the ${name} flavor is not deployed beside the base build` };
      }
    }
    const shared = sharedMemoryStatus();
    let size = threads ?? Math.min(hardwareThreads(), MAX_THREADS);
    if (!shared.canThread && size > 1) {
      notes.push('no SharedArrayBuffer (the page is not cross-origin isolated): one thread');
      size = 1;
    }
    const { min_pages: initial, max_pages: maximum } = manifest.memory;
    let memory;
    try {
      memory = new WebAssembly.Memory({ initial, maximum, shared: true });
    } catch (e) {
      throw new Error(`this engine cannot create the module's shared memory (${e.message}); a browser page `
        + 'needs Cross-Origin-Opener-Policy: same-origin and Cross-Origin-Embedder-Policy: require-corp');
    }
    const module = await WebAssembly.compile(wasm);
    const { exports } = await WebAssembly.instantiate(module, { env: { memory } });
    checkExports(manifest, exports, `${new URL(`${flavored.dir ? `${flavored.dir}/` : ''}kernels.json`, dir)}`);
    const pool = await Pool.start({ module, memory, manifest, exports, threads: size });
    const info = {
      environment: isNode ? `node ${process.versions.node}` : 'browser',
      target: chosen.target,
      targetReason: chosen.why,
      flavor: flavored.flavor,
      flavorReason: flavored.why,
      relaxedDot: relaxed,
      sharedArrayBuffer: shared.sharedArrayBuffer,
      crossOriginIsolated: shared.crossOriginIsolated,
      threads: pool.size,
      notes,
      kernelgen: manifest.kernelgen,
      inputsSha256: manifest.inputs_sha256,
    };
    return new Driver(manifest, memory, exports, pool, info, stopFlag);
  }

  #actArray;
  #sumsArray;
  #exports;
  #memory;
  #pool;
  #top;
  #holes = []; // freed [start, end) ranges below #top, sorted and merged
  #allocated = new Map(); // address -> the [start, end) it took
  #scopes = []; // the allocations of each open #scoped call
  // The Packed handles and held arrays not yet freed, by id: a handle's fields must be those it was
  // given (a copy cloned through postMessage has them; an edited one names memory not its own).
  #packed = new Map();
  #held = new Map();
  #nextPacked = 0; // ids of Packed handles and held arrays
  #id = driverId();
  #generation = 0; // counts reset()s: a Packed from before one names freed memory
  #exportNames = new Map(); // "kernel/quant" -> export name
  #views = new Map(); // typed-array class -> a view of the whole memory (#view)

  constructor(manifest, memory, exports, pool, info, stopFlag) {
    this.manifest = deepFreeze(manifest);
    this.info = info;
    this.stopFlag = stopFlag;
    this.#memory = memory;
    this.#exports = exports;
    this.#pool = pool;
    this.#top = manifest.memory.heap_base;
    // How quantize_act stores activations on this target (Int16Array on simd128, Int8Array on
    // relaxed SIMD): the manifest says.
    this.#actArray = ACT_ARRAYS[manifest.activation.dtype];
    if (!this.#actArray) throw new Error(`unknown activation dtype ${manifest.activation.dtype} in the manifest`);
    this.#sumsArray = ACT_ARRAYS[manifest.activation.sums];
    if (!this.#sumsArray) throw new Error(`unknown activation sums ${manifest.activation.sums} in the manifest`);
    for (const [name, e] of Object.entries(manifest.exports)) this.#exportNames.set(`${e.kernel}/${e.quant}`, name);
  }

  // ---- names ---------------------------------------------------------------------------------

  /** The exported variant of `kernel` (for `quant`), e.g. qmatvec_q8_0__rows1_accs1. */
  exportName(kernel, quant = null) {
    const name = this.#exportNames.get(`${kernel}/${quant}`);
    if (name === undefined) throw new Error(`no export for kernel ${kernel}${quant ? ` and quant ${quant}` : ''}`);
    return name;
  }

  // ---- memory --------------------------------------------------------------------------------

  #live() {
    if (this.#exports === null) throw new Error('these kernels were terminated');
  }

  /** Reserve `nbytes` at an aligned address (not zeroed) until #free, the end of the #scoped call
   * that made it, or reset(): first fit in the ranges freed so far, else above everything in use,
   * growing the memory up to the build's maximum (as kernelgen/host/module.py does). */
  #alloc(nbytes, what = 'a buffer') {
    const { align, max_pages: maxPages } = this.manifest.memory;
    if (!Number.isSafeInteger(nbytes) || nbytes < 0) throw new RangeError(`${what}: cannot allocate ${nbytes} bytes`);
    const n = Math.max(nbytes, 1); // every allocation its own address
    for (let i = 0; i < this.#holes.length; i++) {
      const [start, end] = this.#holes[i];
      const addr = Math.ceil(start / align) * align;
      if (addr + n <= end) {
        const rest = [];
        if (addr > start) rest.push([start, addr]);
        if (addr + n < end) rest.push([addr + n, end]);
        this.#holes.splice(i, 1, ...rest);
        return this.#keep(addr, addr, addr + n);
      }
    }
    const start = this.#top;
    const addr = Math.ceil(start / align) * align;
    const end = addr + n;
    const size = this.#view(Uint8Array).length;
    if (end > size) {
      const need = Math.ceil((end - size) / PAGE_BYTES);
      if (size / PAGE_BYTES + need > maxPages) {
        const limit = maxPages * PAGE_BYTES;
        const used = this.#inUse();
        throw new RangeError(`out of memory: ${what} needs ${nbytes} bytes, and ${limit - used} of the module's ${limit} `
          + `bytes are free (${used - this.manifest.memory.heap_base} in use); free(packed) or reset() frees packed `
          + `weights, or rebuild with a larger maximum (kernelgen build --max-memory; this build allows ${maxPages} pages of 64 KiB)`);
      }
      this.#memory.grow(need);
      this.#views.clear(); // the views end at the old size (or are detached, for unshared memory)
    }
    this.#top = end;
    return this.#keep(addr, start, end);
  }

  #keep(addr, start, end) {
    this.#allocated.set(addr, [start, end]);
    this.#scopes.at(-1)?.push(addr);
    return addr;
  }

  /** Give back the allocation at `addr` (and the alignment padding before it). */
  #free(addr) {
    let [start, end] = this.#allocated.get(addr);
    this.#allocated.delete(addr);
    const holes = this.#holes;
    let i = holes.findIndex(([s]) => s > start);
    if (i < 0) i = holes.length;
    if (i < holes.length && holes[i][0] === end) [, end] = holes.splice(i, 1)[0];
    if (i > 0 && holes[i - 1][1] === start) {
      [[start]] = holes.splice(i - 1, 1);
      i--;
    }
    if (end === this.#top) this.#top = start;
    else holes.splice(i, 0, [start, end]);
  }

  #inUse() {
    return this.#holes.reduce((top, [s, e]) => top - (e - s), this.#top);
  }

  /** A view of the whole memory as `ArrayType`, made once per size of the memory (#alloc grows
   * it): V8 takes a microsecond or more per call to make the views a kernel call copies through
   * (and to collect them), 5% of qmatvec at 256x4096 when each copy made its own. */
  #view(ArrayType) {
    let view = this.#views.get(ArrayType);
    if (view === undefined) {
      view = new ArrayType(this.#memory.buffer);
      this.#views.set(ArrayType, view);
    }
    return view;
  }

  /** Copy typed array `array` to `addr` (a multiple of its element size: #alloc's alignment). */
  #copyIn(array, addr) {
    const C = classOf(array);
    this.#view(C).set(array, addr / C.BYTES_PER_ELEMENT);
  }

  /** Copy a typed array into fresh memory followed by `pad` zero bytes. */
  #put(array, pad = 0) {
    const bytes = byteLengthOf.call(array);
    const addr = this.#alloc(bytes + pad);
    this.#copyIn(array, addr);
    if (pad) this.#view(Uint8Array).fill(0, addr + bytes, addr + bytes + pad);
    return addr;
  }

  /** A copy (on an ordinary ArrayBuffer, transferable) of `count` elements at `addr` (a multiple
   * of their size). */
  #get(addr, ArrayType, count) {
    const at = addr / ArrayType.BYTES_PER_ELEMENT;
    return this.#view(ArrayType).slice(at, at + count);
  }

  /** Run fn with a fresh allocation scope: what it allocates is freed when it returns. */
  #scoped(fn) {
    this.#live();
    this.#scopes.push([]);
    try {
      return fn();
    } finally {
      for (const addr of this.#scopes.pop().reverse()) if (this.#allocated.has(addr)) this.#free(addr);
    }
  }

  /** Free all memory the kernels hold, packed weights included. */
  reset() {
    this.#top = this.manifest.memory.heap_base;
    this.#holes = [];
    this.#allocated.clear();
    this.#packed.clear();
    this.#held.clear();
    this.#generation++;
  }

  /** Give a packed matrix's or a held array's memory back (again: nothing happens). */
  free(w) {
    this.#live();
    if (isHeld(w)) {
      this.#heldAddr(w, 'free', true);
      if (w.generation === this.#generation && this.#held.has(w.id)) {
        this.#free(w.addr);
        this.#held.delete(w.id);
      }
      return;
    }
    this.#packedArgs(w, 'free', true);
    if (w.generation !== this.#generation || !this.#packed.has(w.id)) return;
    for (const addr of Object.values(w.planes)) this.#free(addr);
    this.#packed.delete(w.id);
  }

  // ---- held arrays -------------------------------------------------------------------------

  /** Copy a Float32Array into the module's memory to stay there until free(held) or reset(): a
   * held array {held: true, length, addr, owner, generation, id}. The encoder-layer kernels
   * (linear, gelu, layerNorm, attention) take one wherever they take a Float32Array, with no copy,
   * and return one with {hold: true}. Why: V8 copies into and out of a SharedArrayBuffer by
   * relaxed-atomic moves, and the results come back in fresh arrays, so a model that chains
   * kernels over a few tokens spent more time in the copies than in the kernels; held, its
   * activations stay in memory from one kernel to the next. */
  hold(x) {
    this.#live();
    return this.#holdAt(this.#put(f32Array('hold x', x), VECTOR_BYTES), x.length);
  }

  /** A held array's values, copied out. */
  read(h) {
    this.#live();
    if (!isHeld(h)) throw new TypeError('read: expected a held array (hold(), or a result of {hold: true})');
    return this.#get(this.#heldAddr(h, 'read'), Float32Array, h.length);
  }

  /** A handle to the `length` f32 at `addr` (followed by VECTOR_BYTES zero bytes), an allocation of
   * its own that no scope frees. */
  #holdAt(addr, length) {
    const id = this.#nextPacked++;
    const h = Object.freeze({ held: true, length, addr, owner: this.#id, generation: this.#generation, id });
    this.#held.set(id, h);
    return h;
  }

  /** The address of held array h, checked: these kernels', not freed, from after the last reset(). */
  #heldAddr(h, what, freeing = false) {
    if (!Number.isInteger(h.addr) || !Number.isInteger(h.length) || !Number.isInteger(h.id)) {
      throw new TypeError(`${what}: a held array must come from hold() or {hold: true}`);
    }
    if (h.owner !== this.#id) throw new RangeError(`${what}: this array is held by other kernels`);
    const mine = this.#held.get(h.id);
    if (mine && h.generation === this.#generation && (mine.addr !== h.addr || mine.length !== h.length)) {
      throw new TypeError(`${what}: this held array's fields were changed: use the one hold() returned`);
    }
    if (freeing) return h.addr;
    if (h.generation !== this.#generation) throw new RangeError(`${what}: this array was held before reset(), which freed it`);
    if (!this.#held.has(h.id)) throw new RangeError(`${what}: this held array was freed (free())`);
    return h.addr;
  }

  /** An input's address: a held array's own, else a copy (followed by `pad` zero bytes) freed with
   * the call's scope. */
  #in(what, x, pad = 0) {
    return isHeld(x) ? this.#heldAddr(x, what) : this.#put(f32Array(what, x), pad);
  }

  /** Where a kernel that may write over its input x (copied in at px) writes n results: over the
   * copy, unless x is held (the caller's to keep), then in fresh memory. */
  #outFor(x, px, n) {
    return isHeld(x) ? this.#alloc(4 * n + VECTOR_BYTES) : px;
  }

  /** A kernel's n f32 results at addr (an allocation of the current scope, VECTOR_BYTES longer):
   * copied out, or with {hold: true} kept where they are as a held array. */
  #result(addr, n, opts) {
    flag('hold', opts?.hold);
    if (!opts?.hold) return this.#get(addr, Float32Array, n);
    const scope = this.#scopes.at(-1);
    scope.splice(scope.lastIndexOf(addr), 1);
    new Uint8Array(this.#memory.buffer, addr + 4 * n, VECTOR_BYTES).fill(0);
    return this.#holdAt(addr, n);
  }

  // ---- running kernels -----------------------------------------------------------------------

  /** Run `kernel`'s export here, or with {threads: true}, for a kernel declared `parallel`, through
   * the pool, {chunk} items per claim (same bits: every output element is computed by one thread
   * in a fixed order). */
  #run(kernel, quant, args, opts) {
    opts = options(kernel, opts);
    flag(`${kernel} threads`, opts.threads);
    if (opts.chunk !== undefined && !(Number.isInteger(opts.chunk) && opts.chunk >= 1)) {
      throw new (typeof opts.chunk === 'number' ? RangeError : TypeError)(`${kernel}: chunk (items per claim, with threads) must be an integer >= 1, got ${opts.chunk}`);
    }
    const name = this.exportName(kernel, quant);
    if (!opts?.threads) return this.#exports[name](...args);
    this.#pool.call(name, args, opts.chunk);
    return undefined;
  }

  /** Run any export of `kernel` (for `quant`, or null) with `args`: numbers are passed as they
   * are, each typed array is copied into memory (its address passed) and copied back after the
   * call. {threads, chunk} as for the kernels below. Returns {result, arrays}: the export's
   * result (undefined through the pool) and the typed arrays as the kernel left them. */
  run(kernel, quant, args, opts) {
    this.#live();
    opts = options('run', opts);
    const name = this.exportName(kernel, quant);
    const spec = this.manifest.exports[name];
    if (POOL_EXPORTS.has(spec.kernel)) throw new RangeError(`run: ${name} is the thread pool's own (it waits for helpers or runs a loop)`);
    if (!Array.isArray(args) || args.length !== spec.params.length) {
      throw new TypeError(`run: ${name} takes ${spec.params.length} arguments (${spec.params.map((p) => p.name).join(', ')})`);
    }
    const heap = this.manifest.memory.heap_base;
    const end = this.#memory.buffer.byteLength;
    args.forEach((a, i) => {
      const p = spec.params[i];
      if (ArrayBuffer.isView(a) && p.dsl_type !== 'ptr') {
        throw new TypeError(`run: ${name} ${p.name}: expected ${SCALARS[p.type] ?? p.type}, got a typed array (only pointers take one)`);
      } else if (ArrayBuffer.isView(a)) typedArray(`run ${name} ${p.name}`, a, classOf(a) ?? Float32Array);
      else if (p.dsl_type === 'ptr' && !(Number.isInteger(a) && a >= heap && a < end)) {
        // below heap_base are the pool's words, which a stray write would corrupt (a hang, later);
        // past the memory an i32 address wraps onto them
        throw new RangeError(`run: ${name} ${p.name}: an address in the heap (${heap} .. ${end - 1}) or a typed array, got ${a}`);
      } else if (p.dsl_type !== 'ptr' && !scalarFits(p.type, a)) {
        throw new TypeError(`run: ${name} ${p.name}: expected ${SCALARS[p.type] ?? p.type}, got ${typeof a} ${String(a)}`);
      }
    });
    const read = (i, offset) => (ArrayBuffer.isView(args[i])
      ? new DataView(args[i].buffer, args[i].byteOffset, args[i].byteLength)
      : new DataView(this.#memory.buffer, args[i])).getInt32(offset, true);
    checkArguments(`run: ${name}`, spec, args, end, args.map((a) => (ArrayBuffer.isView(a) ? a.byteLength : undefined)), read);
    return this.#scoped(() => {
      const addrs = args.map((a) => (ArrayBuffer.isView(a) ? this.#put(a, VECTOR_BYTES) : a));
      const result = this.#run(kernel, quant, addrs, opts);
      const arrays = args.flatMap((a, i) => (ArrayBuffer.isView(a) ? [this.#get(addrs[i], classOf(a), lengthOf.call(a))] : []));
      return { result, arrays };
    });
  }

  /** Run a pool job by its manifest name with raw argument words (addresses and scalars). */
  runJob(job, count, chunk, args) {
    this.#live();
    this.#pool.run(job, count, chunk, args);
  }

  /** Use `k` threads (1 .. the pool's size) for threaded calls from now on. */
  setThreads(k) {
    this.#live();
    this.#pool.setThreads(k);
  }

  // ---- weights and activations ---------------------------------------------------------------

  /** f32[tokens * k] (k a positive multiple of 32: `tokens` rows of k values) -> {q, d, s}: q
   * Int16Array on simd128 (int8 values, stored widened and, as manifest.activation.split says,
   * each 16 as the 8 at even positions then the 8 at odd ones), Int8Array (the same values, in
   * order) on relaxed SIMD: the kernels' layout, passed back to them as it is; d one f32 scale per
   * 32 values; s the sum of each 32 values (Int32Array: manifest.activation.sums, which kernels
   * read after the scales). Blocks never cross rows, so the tokens are one call over
   * all the values. */
  quantizeAct(x, tokens = 1) {
    f32Array('quantizeAct x', x);
    positiveInt('quantizeAct tokens', tokens);
    const k = x.length / tokens;
    if (x.length === 0 || !Number.isInteger(k) || k % ACT_BLOCK) {
      throw new RangeError(`quantizeAct: need ${tokens} row(s) of a positive multiple of ${ACT_BLOCK} values, got ${x.length} values`);
    }
    return this.#scoped(() => {
      const px = this.#put(x);
      const nb = x.length / ACT_BLOCK;
      const [pq, pd] = this.#actBuffers(x.length);
      this.#exports[this.exportName('quantize_act')](px, x.length, pq, pd);
      return { q: this.#get(pq, this.#actArray, x.length), d: this.#get(pd, Float32Array, nb), s: this.#get(pd + nb * 4, this.#sumsArray, nb) };
    });
  }

  /** Fresh buffers for quantize_act of n values, sized as manifest.activation says: the stored
   * values, and the scales followed by the sums. */
  #actBuffers(n) {
    return [this.#alloc(n * this.#actArray.BYTES_PER_ELEMENT), this.#alloc((n / ACT_BLOCK) * (4 + this.#sumsArray.BYTES_PER_ELEMENT))];
  }

  /** Stored blocks (`rows` rows of k / block blocks, each stored_bytes bytes) -> a Packed handle
   * {quant, rows, k, planes: {name: address}} to weights that stay in memory until free() or reset(). */
  pack(quant, blocks, rows, k) {
    this.#live();
    if (typeof quant !== 'string' || !Object.hasOwn(this.manifest.quants, quant)) {
      throw new TypeError(`unknown quant type ${String(quant)}; this build has ${Object.keys(this.manifest.quants).join(', ')}`);
    }
    const spec = this.manifest.quants[quant];
    checkBlocks(`pack(${quant})`, spec, blocks, rows, k);
    const planes = {};
    const views = {};
    const held = paddedRows(spec, rows) * (k / spec.block); // blocks the planes hold: whole groups of rows
    try {
      for (const [name, { Array, perBlock }] of Object.entries(planeLayout(spec))) {
        planes[name] = this.#alloc(perBlock * held * Array.BYTES_PER_ELEMENT, `pack('${quant}') of ${rows} rows, plane '${name}',`);
        views[name] = new Array(this.#memory.buffer, planes[name], perBlock * held);
      }
      packInto(spec, blocks, rows, k, views);
    } catch (e) {
      for (const addr of Object.values(planes)) this.#free(addr); // the planes are packed in place: give them back
      throw e instanceof RangeError && e.message.startsWith('out of memory') ? e : new RangeError(`pack(${quant}): ${e.message}`);
    }
    const id = this.#nextPacked++;
    const w = Object.freeze({ quant, rows, k, planes: Object.freeze(planes), owner: this.#id, generation: this.#generation, id });
    this.#packed.set(id, w);
    return w;
  }

  #packedArgs(w, what, freeing = false) {
    const spec = typeof w?.quant === 'string' && Object.hasOwn(this.manifest.quants, w.quant) ? this.manifest.quants[w.quant] : null;
    const names = spec && Object.keys(spec.planes);
    if (!spec || !w.planes || names.some((n) => !Number.isInteger(w.planes[n])) || !Number.isInteger(w.rows) || !Number.isInteger(w.k)) {
      throw new TypeError(`${what}: weights must come from pack()`);
    }
    if (w.owner !== this.#id) throw new RangeError(`${what}: these weights were packed by other kernels; pack them with these`);
    const mine = this.#packed.get(w.id);
    if (mine && w.generation === this.#generation && (mine.quant !== w.quant || mine.rows !== w.rows || mine.k !== w.k
        || names.some((n) => mine.planes[n] !== w.planes[n]))) {
      throw new TypeError(`${what}: these weights' fields were changed: use the handle pack() returned`);
    }
    if (freeing) return null;
    if (w.generation !== this.#generation) throw new RangeError(`${what}: these weights were packed before reset(), which freed them; pack them again`);
    if (!this.#packed.has(w.id)) throw new RangeError(`${what}: these weights were freed (free()); pack them again`);
    return names.map((n) => w.planes[n]); // the kernels take the planes in the manifest's order
  }

  /** Addresses of act's values and of its scales followed by its sums: `tokens` rows of k values
   * (1 for qdot and qmatvec). */
  // Reading act may run code (a getter) that frees or repacks weights: callers check their weights
  // again after it.
  #actArgs(act, k, what, tokens = 1) {
    if (!(act?.q instanceof this.#actArray) || !(act.d instanceof Float32Array) || !(act.s instanceof this.#sumsArray)) {
      throw new TypeError(`${what}: activations must come from quantizeAct (q a ${this.#actArray.name} on ${this.info.target}, `
        + `d a Float32Array, s an ${this.#sumsArray.name})`);
    }
    const q = typedArray(`${what} act.q`, act.q, this.#actArray);
    const s = typedArray(`${what} act.s`, act.s, this.#sumsArray);
    typedArray(`${what} act.d`, act.d, Float32Array);
    const nb = (tokens * k) / ACT_BLOCK;
    if (q.length !== tokens * k || act.d.length !== nb || s.length !== nb) {
      throw new RangeError(`${what}: activations have ${q.length} values, ${act.d.length} scales and ${s.length} sums, `
        + `${tokens} token(s) of the weights' rows need ${tokens * k}`);
    }
    const pd = this.#alloc(act.d.byteLength + act.s.byteLength);
    this.#copyIn(act.d, pd);
    this.#copyIn(act.s, pd + act.d.byteLength);
    const pq = this.#put(act.q);
    // The kernels trust the values' range (relaxed SIMD reads |a| in 7 bits) and each block's sum (a
    // weight type's zero or minimum comes off with it): every activation object is checked, one
    // quantizeAct made too (its arrays can be edited), in wasm (act_check: a JavaScript loop over
    // the values took 13% of a 256x4096 qmatvec); the first bad block is then named from here.
    const bad = this.#exports[this.exportName('act_check')](pq, pd, q.length);
    if (bad >= 0) {
      const max = this.manifest.activation.max;
      const block = q.subarray(bad * ACT_BLOCK, (bad + 1) * ACT_BLOCK);
      const out = block.find((v) => v < -max || v > max);
      if (out !== undefined) throw new RangeError(`${what}: activation values must lie in [-${max}, ${max}] (quantizeAct's range), got ${out}`);
      const sum = block.reduce((a, v) => a + v, 0);
      throw new RangeError(`${what}: activation sums do not match the values (block ${bad}: ${s[bad]}, the values sum to ${sum}); `
        + 'make activations with quantizeAct');
    }
    return [pq, pd];
  }

  // ---- kernels -------------------------------------------------------------------------------

  /** Dot of a one-row packed matrix with quantized activations: qmatvec of that row (the library
   * holds one row sum per quant type, not a second copy for a dot export). */
  qdot(w, act) {
    this.#packedArgs(w, 'qdot');
    if (w.rows !== 1) throw new RangeError(`qdot: expected one packed row, got ${w.rows} (use qmatvec)`);
    return this.#scoped(() => {
      const py = this.#alloc(4);
      const a = this.#actArgs(act, w.k, 'qdot');
      this.#run('qmatvec', w.quant, [...this.#packedArgs(w, 'qdot'), ...a, py, 1, w.k]); // (again: see #actArgs)
      return this.#get(py, Float32Array, 1)[0];
    });
  }

  /** y = W a, Float32Array(rows). */
  qmatvec(w, act, opts) {
    this.#packedArgs(w, 'qmatvec');
    return this.#scoped(() => {
      const a = this.#actArgs(act, w.k, 'qmatvec');
      const py = this.#alloc(4 * w.rows);
      this.#run('qmatvec', w.quant, [...this.#packedArgs(w, 'qmatvec'), ...a, py, w.rows, w.k], opts); // (again: see #actArgs)
      return this.#get(py, Float32Array, w.rows);
    });
  }

  /** Y = A W^T for activations of m tokens (quantizeAct(x, m): m = act.q.length / k) ->
   * Float32Array(m * rows), row-major: row t is qmatvec of token t, bit for bit. Threaded, the rows
   * of W are split. */
  qmatmul(w, act, opts) {
    this.#packedArgs(w, 'qmatmul');
    const m = act?.q?.length / w.k;
    if (!Number.isInteger(m) || m < 1) {
      throw new RangeError(`qmatmul: activations hold ${act?.q?.length} values, not whole rows of the weights' ${w.k}`);
    }
    return this.#scoped(() => {
      const a = this.#actArgs(act, w.k, 'qmatmul', m);
      const py = this.#alloc(4 * m * w.rows);
      const args = [...this.#packedArgs(w, 'qmatmul'), ...a, py, m, w.rows, w.k]; // (again: see #actArgs)
      this.#run('qmatmul', w.quant, args, opts);
      return this.#get(py, Float32Array, m * w.rows);
    });
  }

  dotF32(x, y) {
    f32Array('dotF32 x', x);
    f32Array('dotF32 y', y);
    if (x.length !== y.length) throw new RangeError(`dotF32: lengths differ, ${x.length} and ${y.length}`);
    return this.#scoped(() => this.#exports[this.exportName('dot_f32')](this.#put(x), this.#put(y), x.length));
  }

  /** y = W x for row-major w (its length a multiple of x's: rows = w.length / x.length). */
  matvecF32(w, x, opts) {
    f32Array('matvecF32 w', w);
    f32Array('matvecF32 x', x);
    if (x.length === 0 || w.length % x.length) {
      throw new RangeError(`matvecF32: w has ${w.length} values, not whole rows of x's ${x.length}`);
    }
    const rows = w.length / x.length;
    return this.#scoped(() => {
      const py = this.#alloc(4 * rows);
      const pw = this.#put(w);
      const px = this.#put(x);
      this.#run('matvec_f32', null, [pw, px, py, rows, x.length], opts);
      return this.#get(py, Float32Array, rows);
    });
  }

  /** a[m, k] b[k, n] (attention's P V), or with {bTransposed: true} a[m, k] b[n, k]^T (Q K^T), all
   * row-major -> Float32Array(m * n). Threaded, the rows of a are split. */
  matmulF32(a, b, m, n, opts) {
    opts = options('matmulF32', opts);
    flag('matmulF32 bTransposed', opts.bTransposed);
    f32Array('matmulF32 a', a);
    f32Array('matmulF32 b', b);
    positiveInt('matmulF32 m', m);
    positiveInt('matmulF32 n', n);
    const k = a.length / m;
    if (!Number.isInteger(k) || b.length !== n * k) {
      throw new RangeError(`matmulF32: a has ${a.length} values (m=${m} rows), b needs n * k = ${n} * ${k}, has ${b.length}`);
    }
    const kernel = opts.bTransposed ? 'matmul_f32_nt' : 'matmul_f32_nn';
    return this.#scoped(() => {
      const pa = this.#put(a);
      const pb = this.#put(b);
      const py = this.#alloc(4 * m * n);
      this.#run(kernel, null, [pa, pb, py, m, n, k], opts);
      return this.#get(py, Float32Array, m * n);
    });
  }

  /** An elementwise kernel `kernel(in..., out, n)` over equal-length arrays. */
  #map(kernel, inputs, opts) {
    const n = inputs[0].length;
    if (inputs.some((a) => a.length !== n)) throw new RangeError(`${kernel}: lengths differ, ${inputs.map((a) => a.length).join(', ')}`);
    return this.#scoped(() => {
      const ins = inputs.map((a) => this.#put(a, VECTOR_BYTES));
      const out = this.#alloc(4 * n + VECTOR_BYTES);
      this.#run(kernel, null, [...ins, out, n], opts);
      return this.#get(out, Float32Array, n);
    });
  }

  exp(x, opts) {
    return this.#map('exp_f32', [f32Array('exp x', x)], opts);
  }

  silu(x, opts) {
    return this.#map('silu_f32', [f32Array('silu x', x)], opts);
  }

  /** silu(x) * g. */
  swiglu(x, g, opts) {
    return this.#map('swiglu_f32', [f32Array('swiglu x', x), f32Array('swiglu g', g)], opts);
  }

  // ---- encoder layers (BERT) -------------------------------------------------------------------

  erf(x) {
    return this.#map('erf_f32', [f32Array('erf x', x)]);
  }

  /** Rows of n values, n a positive multiple of LANES: x holds whole rows -> the row count. */
  #rows(what, x, n) {
    f32Input(what, x);
    if (typeof n !== 'number') throw new TypeError(`${what}: the row length n must be a number, got ${typeof n} ${String(n)}`);
    if (!Number.isInteger(n) || n < 1 || n % LANES || x.length % n) {
      throw new RangeError(`${what}: rows of a positive multiple of ${LANES} values, whole rows; got ${x.length} values, n=${n}`);
    }
    return x.length / n;
  }

  /** A row vector of n values in memory (zeros for null: the kernels always add a bias). */
  #putRow(what, v, n) {
    if (v === null || v === undefined) return this.#put(new Float32Array(n));
    f32Input(what, v);
    if (v.length !== n) throw new RangeError(`${what}: expected ${n} values (the row length), got ${v.length}`);
    return this.#in(what, v);
  }

  /** gelu(x + bias) in BERT's erf form, per row of bias.length values (bias null: n = x.length). */
  gelu(x, bias, opts) {
    const n = bias?.length ?? x?.length;
    const rows = this.#rows('gelu x', x, n);
    return this.#scoped(() => {
      const pb = this.#putRow('gelu bias', bias, n);
      const px = this.#in('gelu x', x, VECTOR_BYTES);
      const py = this.#outFor(x, px, x.length);
      this.#run('gelu_f32', null, [px, pb, py, rows, n], opts);
      return this.#result(py, x.length, opts);
    });
  }

  /** x + bias per row of bias.length values. */
  addBias(x, bias) {
    f32Array('addBias x', x); // copied in: not a held array
    const rows = this.#rows('addBias x', x, f32Array('addBias bias', bias).length);
    return this.#scoped(() => {
      const pb = this.#put(bias);
      const px = this.#put(x);
      this.#exports[this.exportName('add_bias_f32')](px, pb, px, rows, bias.length);
      return this.#get(px, Float32Array, x.length);
    });
  }

  /** x W^T + bias (null: none) for x of m rows of w.k values -> m rows of w.rows values: quantize_act,
   * qmatmul and add_bias_f32 in one call, the activations and the product never leaving the
   * module's memory. Bit for bit addBias(qmatmul(w, quantizeAct(x, m)), bias). Threaded, the
   * quantization's blocks and then W's rows are split ({chunk} is qmatmul's). */
  linear(w, x, bias, opts) {
    opts = options('linear', opts);
    const planes = this.#packedArgs(w, 'linear');
    const m = f32Input('linear x', x).length / w.k;
    if (!Number.isInteger(m) || m < 1) throw new RangeError(`linear: x holds ${x.length} values, not whole rows of the weights' ${w.k}`);
    const withBias = bias !== null && bias !== undefined;
    if (withBias && w.rows % LANES) throw new RangeError(`linear: a bias needs rows of a multiple of ${LANES} values; the weights have ${w.rows}`);
    return this.#scoped(() => {
      const pb = withBias ? this.#putRow('linear bias', bias, w.rows) : 0;
      const px = this.#in('linear x', x);
      const [pq, pd] = this.#actBuffers(x.length);
      this.#run('quantize_act', null, [px, x.length, pq, pd], { threads: opts.threads });
      const py = this.#alloc(4 * m * w.rows + VECTOR_BYTES);
      this.#run('qmatmul', w.quant, [...planes, pq, pd, py, m, w.rows, w.k], opts);
      if (withBias) this.#exports[this.exportName('add_bias_f32')](py, pb, py, m, w.rows);
      return this.#result(py, m * w.rows, opts);
    });
  }

  /** LayerNorm of each row (gamma.length values) of x + residual + bias (either may be null). */
  layerNorm(x, gamma, beta, residual, bias, eps, opts) {
    const n = f32Input('layerNorm gamma', gamma).length;
    const rows = this.#rows('layerNorm x', x, n);
    if (residual !== null && residual !== undefined && f32Input('layerNorm residual', residual).length !== x.length) {
      throw new RangeError(`layerNorm: residual has ${residual.length} values, x ${x.length}`);
    }
    if (typeof eps !== 'number' || !(eps >= 0)) throw new RangeError(`layerNorm: eps must be a number >= 0, got ${eps}`);
    return this.#scoped(() => {
      const px = this.#in('layerNorm x', x, VECTOR_BYTES);
      const args = [px, this.#in('layerNorm residual', residual ?? new Float32Array(x.length)), this.#putRow('layerNorm bias', bias, n),
        this.#putRow('layerNorm gamma', gamma, n), this.#putRow('layerNorm beta', beta, n), this.#outFor(x, px, x.length)];
      this.#run('layernorm_f32', null, [...args, rows, n, eps], opts);
      return this.#result(args[5], x.length, opts);
    });
  }

  /** Multi-head self-attention of sentences whose tokens are the rows of qkv (q | k | v per
   * token, each heads * d values, queries scaled by 1 / sqrt(d)), lengths[s] tokens for sentence s
   * in row order: each query sees only its own sentence's keys -> Float32Array(rows * heads * d).
   * Threaded, the (sentence, head) pairs are split. */
  attention(qkv, lengths, heads, opts) {
    f32Input('attention qkv', qkv);
    positiveInt('attention heads', heads);
    if (!Array.isArray(lengths) || lengths.length === 0 || lengths.some((l) => !Number.isInteger(l) || l < 1 || l > I32_MAX)) {
      throw new RangeError(`attention: lengths must be a non-empty array of positive integers, got ${lengths}`);
    }
    const rows = lengths.reduce((a, b) => a + b, 0);
    const width = qkv.length / rows;
    const d = width / (3 * heads);
    if (!Number.isInteger(d) || d < 1 || d % 16) {
      throw new RangeError(`attention: qkv must hold rows (the lengths' sum, ${rows}) of 3 * heads * d values with d a multiple of 16; `
        + `got ${qkv.length} values for heads=${heads}`);
    }
    const stride = Math.ceil(lengths.reduce((a, b) => Math.max(a, b), 0) / LANES) * LANES;
    const starts = new Int32Array(lengths.length + 1);
    lengths.forEach((l, s) => { starts[s + 1] = starts[s] + l; });
    return this.#scoped(() => {
      const pq = this.#in('attention qkv', qkv);
      const ps = this.#put(starts);
      const scratch = this.#alloc(4 * lengths.length * heads * stride);
      const py = this.#alloc(4 * rows * heads * d + VECTOR_BYTES);
      this.#run('attention_f32', null, [pq, ps, scratch, py, lengths.length, heads, d, stride], opts);
      return this.#result(py, rows * heads * d, opts);
    });
  }

  /** Mean of each sequence's token vectors under its mask: x[seqs * t * n], mask[seqs * t] (0 for
   * padding) -> Float32Array(seqs * n). */
  meanPool(x, mask, seqs) {
    f32Array('meanPool x', x);
    f32Array('meanPool mask', mask);
    if (!Number.isInteger(seqs) || seqs < 1 || mask.length % seqs || mask.length === 0) {
      throw new RangeError(`meanPool: mask must hold seqs * t values; got ${mask.length} for seqs=${seqs}`);
    }
    const n = x.length / mask.length;
    this.#rows('meanPool x', x, n);
    return this.#scoped(() => {
      const px = this.#put(x);
      const pm = this.#put(mask);
      const py = this.#alloc(4 * seqs * n);
      this.#exports[this.exportName('mean_pool_f32')](px, pm, py, seqs, mask.length / seqs, n);
      return this.#get(py, Float32Array, seqs * n);
    });
  }

  /** Each row of n values at unit length (a zero row stays zero). */
  l2Normalize(x, n) {
    f32Array('l2Normalize x', x); // copied in: not a held array
    const rows = this.#rows('l2Normalize x', x, n);
    return this.#scoped(() => {
      const px = this.#put(x);
      this.#exports[this.exportName('l2_normalize_f32')](px, px, rows, n);
      return this.#get(px, Float32Array, x.length);
    });
  }

  /** Softmax over the first t of every `stride` values (stride a multiple of 4, the padding after
   * column t kept as it is); returns the whole array as the kernel left it. */
  softmax(x, t, stride, opts) {
    f32Array('softmax x', x);
    if (!Number.isInteger(stride) || stride < 1 || stride % LANES || !Number.isInteger(t) || t < 1 || t > stride || x.length % stride) {
      throw new RangeError(`softmax: need 1 <= t <= stride, stride a multiple of ${LANES} and whole rows; got t=${t}, `
        + `stride=${stride}, ${x.length} values`);
    }
    const rows = x.length / stride;
    return this.#scoped(() => {
      const p = this.#put(x);
      this.#run('softmax_f32', null, [p, rows, t, stride], opts);
      return this.#get(p, Float32Array, x.length);
    });
  }

  /** cos and sin tables, Float32Array(npos * dim / 2) each, of angles (pos0 + p) * theta^(-2i / dim). */
  ropeTable(npos, dim, theta = 10000, pos0 = 0) {
    const kinds = Object.entries({ npos, dim, theta, pos0 }).filter(([, v]) => typeof v !== 'number');
    if (kinds.length) throw new TypeError(`ropeTable: expected numbers, got ${kinds.map(([n, v]) => `${n} ${typeof v}`).join(', ')}`);
    if (!Number.isInteger(dim) || dim <= 0 || dim % 2 || dim > I32_MAX || !Number.isInteger(npos) || npos < 0
        || !Number.isInteger(pos0) || pos0 < 0 || npos + pos0 > I32_MAX || !(theta >= 1 && theta < Infinity)) {
      // theta >= 1 keeps every angle at most the position, within the sin/cos argument reduction's range
      throw new RangeError(`ropeTable: need integers dim (even, > 0), npos >= 0 and pos0 >= 0 with npos + pos0 <= ${I32_MAX}, `
        + `and a finite theta >= 1; got dim=${dim}, npos=${npos}, pos0=${pos0}, theta=${theta}`);
    }
    return this.#scoped(() => {
      const n = npos * (dim / 2);
      const pc = this.#alloc(4 * n);
      const ps = this.#alloc(4 * n);
      this.#exports[this.exportName('rope_table')](pc, ps, pos0, npos, dim, theta);
      return { cos: this.#get(pc, Float32Array, n), sin: this.#get(ps, Float32Array, n) };
    });
  }

  /** Rotate heads x[heads * dim] by one position's table rows (cos, sin: dim / 2 values);
   * {interleaved: true} pairs (x[2i], x[2i+1]), else (x[i], x[i + dim/2]). Returns a rotated copy. */
  rope(x, cos, sin, opts = {}) {
    f32Array('rope x', x);
    f32Array('rope cos', cos);
    f32Array('rope sin', sin);
    opts = options('rope', opts);
    flag('rope interleaved', opts.interleaved);
    const dim = 2 * cos.length;
    if (dim === 0 || dim % 8 || sin.length !== cos.length || x.length % dim) {
      throw new RangeError(`rope: cos and sin hold dim / 2 values with dim a multiple of 8, x whole heads; got `
        + `${x.length} values, cos ${cos.length}, sin ${sin.length}`);
    }
    const heads = x.length / dim;
    const kind = opts.interleaved ? 'pairs' : 'halves';
    return this.#scoped(() => {
      const p = this.#put(x);
      const pc = this.#put(cos);
      const ps = this.#put(sin);
      this.#run(`rope_${kind}_f32`, null, [p, pc, ps, heads, dim], opts);
      return this.#get(p, Float32Array, x.length);
    });
  }

  // ---- benchmarks, shutdown ------------------------------------------------------------------

  /**
   * Call API method `method` with `args` again and again in this thread: untimed for `warmupMs`
   * (the engine compiles hot code again, optimized, after a while), then timed for about `minMs`,
   * at most `maxIterations` times. A nonzero stop flag ends the loop early.
   * Returns {iterations, msPerCall, stopped}.
   */
  bench(method, args, opts) {
    const { minMs = 200, warmupMs = minMs / 4, maxIterations = 10_000 } = options('bench', opts);
    if (!API.includes(method) || method === 'bench') throw new TypeError(`bench: not an API method: ${method}`);
    if (!Array.isArray(args)) throw new TypeError(`bench: args must be an array of ${method}'s arguments`);
    for (const [name, v, most] of [['minMs', minMs, 600_000], ['warmupMs', warmupMs, 600_000], ['maxIterations', maxIterations, 1e9]]) {
      if (typeof v !== 'number' || !(v >= 0 && v <= most) || (name === 'maxIterations' && !(Number.isInteger(v) && v >= 1))) {
        throw new RangeError(`bench: ${name} must be a number in 0..${most}${name === 'maxIterations' ? ' (an integer >= 1)' : ''}, got ${v}`);
      }
    }
    const flag = this.stopFlag;
    if (flag) Atomics.store(flag, 0, 0);
    const loop = (ms, most) => {
      const start = performance.now();
      let now = start;
      let iterations = 0;
      while (iterations < most && (iterations === 0 || now - start < ms)) {
        if (flag && Atomics.load(flag, 0)) return { iterations, ms: now - start, stopped: true };
        const result = this[method](...args);
        if (isHeld(result) || (result?.planes && result.owner === this.#id)) this.free(result); // one call's memory, not the loop's
        iterations++;
        now = performance.now();
      }
      return { iterations, ms: now - start, stopped: false };
    };
    const warm = loop(warmupMs, maxIterations);
    if (warm.stopped) return { iterations: 0, msPerCall: NaN, stopped: true };
    const { iterations, ms, stopped } = loop(minMs, maxIterations);
    return { iterations, msPerCall: iterations ? ms / iterations : NaN, stopped };
  }

  /** Stop the pool's workers and let go of the memory. */
  async close() {
    if (this.#exports === null) return;
    this.#exports = null;
    try {
      await this.#pool.close();
    } finally {
      this.#memory = null;
      this.#pool = null;
    }
  }
}
