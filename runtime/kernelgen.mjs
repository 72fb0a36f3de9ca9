// kernelgen's JavaScript runtime: load a built target (out/<target>/kernels.{wasm,json}) and run
// its kernels on typed arrays, threaded through the generated pool.
//
//   import { loadKernels } from './runtime/kernelgen.mjs';
//   const k = await loadKernels({ threads: 4 });          // picks relaxed-simd or simd128
//   const w = await k.pack('q8_0', blocks, rows, cols);    // GGUF Q8_0 blocks, Uint8Array
//   const a = await k.quantizeAct(x);                      // Float32Array(cols)
//   const y = await k.qmatvec(w, a, { threads: true });    // Float32Array(rows)
//   await k.terminate();
//
// Every call returns a promise, in Node and in browsers alike. In Node and in a browser's dedicated
// worker the calls run on this thread (which may block while the pool works); on a page's main
// thread, which may not block, they run in a driver worker the page talks to with postMessage (so
// a model that makes many calls runs faster from a worker of its own: no message per call).

import { API, Driver, deepFreeze } from './driver.mjs';
import { mayBlock, startWorker } from './platform.mjs';
import { JobError } from './pool.mjs';

export { probeRelaxedDot } from './features.mjs';
export { GGML_TYPES, GgufError, loadGguf, readGgufInfo } from './gguf.mjs';
export { packPlanes } from './pack.mjs';
export { JobError };

const ERRORS = { TypeError, RangeError, JobError };

/** An error posted by the driver worker, as the class it was thrown as. */
function revive({ name, message, driverError, helperErrors }) {
  if (name === 'JobError') return new JobError(message, driverError, helperErrors);
  const e = new (ERRORS[name] ?? Error)(message);
  if (!(name in ERRORS)) e.name = name;
  return e;
}

/** The build directory as a URL ending in '/'. */
async function outUrl(baseUrl, dir) {
  if (dir !== undefined) {
    if (typeof dir !== 'string') throw new TypeError(`loadKernels: dir must be a filesystem path (a string), got ${dir === null ? 'null' : typeof dir}`);
    const [{ pathToFileURL }, { resolve }] = await Promise.all([import('node:url'), import('node:path')]);
    return pathToFileURL(`${resolve(dir)}/`);
  }
  if (baseUrl === undefined) return new URL('../out/', import.meta.url); // out/ beside runtime/
  const url = new URL(baseUrl, globalThis.location?.href);
  return url.href.endsWith('/') ? url : new URL(`${url.href}/`);
}

/** Start the driver worker (browsers) and wait until it has loaded the kernels. */
function startDriver(options) {
  const worker = startWorker('kernelgen-driver');
  const pending = new Map();
  let nextId = 0;
  let failed = null;
  const ready = new Promise((resolve, reject) => {
    worker.onMessage((m) => {
      if (m.type === 'ready') resolve(m);
      else if (m.type === 'failed') reject(revive(m.error));
      else {
        const call = pending.get(m.id);
        pending.delete(m.id);
        if (m.ok) call.resolve(m.value);
        else call.reject(revive(m.error));
      }
    });
    worker.onError((e) => {
      failed = e;
      reject(e);
      for (const call of pending.values()) call.reject(e);
      pending.clear();
    });
  });
  worker.post({ role: 'driver', ...options });
  const invoke = (method, args) => new Promise((resolve, reject) => {
    if (failed) throw failed;
    const id = nextId++;
    pending.set(id, { resolve, reject });
    worker.post({ id, method, args });
  });
  const close = async () => {
    try {
      await invoke('close', []);
    } finally {
      worker.terminate();
    }
  };
  return ready.then(({ info, manifest }) => ({ invoke, close, info, manifest }), (e) => {
    worker.terminate();
    throw e;
  });
}

/**
 * Load the kernels. Options:
 *   baseUrl  URL of the build's out/ directory (default: out/ beside runtime/)
 *   dir      the same as a filesystem path (Node)
 *   target   'relaxed-simd' or 'simd128' (default: relaxed SIMD where the engine has it and its
 *            integer dot is exact in the kernels' 7-bit contract, else simd128)
 *   flavor   'auto' (default: the build's flavor that suits this engine's relaxed dot, if any:
 *            the same kernels and results, faster there), 'base' or a flavor's name
 *   threads  threads in the pool, the calling side included (default: the machine's; one
 *            without shared memory, i.e. on a page that is not cross-origin isolated)
 * The returned Kernels' `info` says what was chosen and why.
 */
export async function loadKernels(opts = {}) {
  if (opts === null || typeof opts !== 'object') {
    throw new TypeError(`loadKernels: options must be an object ({baseUrl, dir, target, flavor, threads}), got ${opts === null ? 'null' : typeof opts}`);
  }
  const { baseUrl, dir, target, flavor, threads } = opts;
  const base = await outUrl(baseUrl, dir);
  // A bench loop checks this flag between calls: the driver cannot take messages while it runs.
  const stopFlag = typeof SharedArrayBuffer === 'function' ? new Int32Array(new SharedArrayBuffer(4)) : null;
  const options = { baseUrl: base.href, target, flavor, threads, stopFlag };
  if (mayBlock) {
    const driver = await Driver.load({ ...options, baseUrl: base });
    const invoke = async (method, args) => {
      if (!API.includes(method)) throw new Error(`not an API method: ${method}`);
      return driver[method](...args);
    };
    return new Kernels({ invoke, close: () => driver.close(), info: driver.info, manifest: driver.manifest }, stopFlag);
  }
  return new Kernels(await startDriver(options), stopFlag);
}

/** The kernels of one loaded target. Options objects take {threads: true} to run a kernel's job
 * through the pool (bit-identical to one thread) and {chunk} to set the items per claim. */
export class Kernels {
  #invoke;
  #close;

  constructor({ invoke, close, info, manifest }, stopFlag) {
    this.#invoke = invoke;
    this.#close = close;
    /** What was loaded and why: target, targetReason, relaxedDot (the probe), threads, notes... */
    this.info = info;
    this.manifest = deepFreeze(manifest); // the driver's own in Node, a copy on a page: read-only either way
    /** Int32Array[1] on a SharedArrayBuffer (null without one): nonzero ends a bench loop. */
    this.stopFlag = stopFlag;
  }

  /** Float32Array(tokens * k), k a positive multiple of 32 -> {q, d}: q the int8 values, as an
   * Int16Array (simd128) or Int8Array (relaxed SIMD), d one Float32 scale per 32 values. */
  quantizeAct(x, tokens = 1) { return this.#invoke('quantizeAct', [x, tokens]); }

  /** Stored blocks (Uint8Array: rows * k / block blocks of the type's stored bytes, e.g. GGUF
   * Q8_0) -> a Packed handle {quant, rows, k, planes, owner, generation, id} to weights kept until
   * free(packed) or reset(); these kernels refuse a handle of other kernels, from before a reset() or freed. */
  pack(quant, blocks, rows, k) { return this.#invoke('pack', [quant, blocks, rows, k]); }

  /** Dot of a one-row Packed with activations from quantizeAct -> number. */
  qdot(packedRow, act) { return this.#invoke('qdot', [packedRow, act]); }

  /** y = W a -> Float32Array(rows). */
  qmatvec(packed, act, opts) { return this.#invoke('qmatvec', [packed, act, opts]); }

  /** Y = A W^T for activations of m tokens (quantizeAct(x, m)) -> Float32Array(m * rows), row t
   * equal to qmatvec of token t bit for bit. */
  qmatmul(packed, act, opts) { return this.#invoke('qmatmul', [packed, act, opts]); }

  /** x . y -> number. */
  dotF32(x, y) { return this.#invoke('dotF32', [x, y]); }

  /** y = W x, w row-major with rows of x.length -> Float32Array(w.length / x.length). */
  matvecF32(w, x, opts) { return this.#invoke('matvecF32', [w, x, opts]); }

  /** a[m, k] b[k, n] (P V), or with {bTransposed: true} a[m, k] b[n, k]^T (Q K^T), row-major ->
   * Float32Array(m * n). */
  matmulF32(a, b, m, n, opts) { return this.#invoke('matmulF32', [a, b, m, n, opts]); }

  /** exp(x) -> Float32Array. */
  exp(x, opts) { return this.#invoke('exp', [x, opts]); }

  /** Softmax over the first t of each `stride` values (stride a multiple of 4) -> a new array. */
  softmax(rows, t, stride, opts) { return this.#invoke('softmax', [rows, t, stride, opts]); }

  /** Rotate heads x (whole heads of dim = 2 * cos.length) by one position's table rows;
   * {interleaved: true} for adjacent pairs, else halves -> a new array. */
  rope(x, cos, sin, opts) { return this.#invoke('rope', [x, cos, sin, opts]); }

  /** {cos, sin}, Float32Array(npos * dim / 2) each, of angles (pos0 + p) * theta^(-2i / dim). */
  ropeTable(npos, dim, theta = 10000, pos0 = 0) { return this.#invoke('ropeTable', [npos, dim, theta, pos0]); }

  /** x * sigmoid(x) -> Float32Array. */
  silu(x, opts) { return this.#invoke('silu', [x, opts]); }

  /** silu(x) * g -> Float32Array. */
  swiglu(x, g, opts) { return this.#invoke('swiglu', [x, g, opts]); }

  /** erf(x) -> Float32Array. */
  erf(x) { return this.#invoke('erf', [x]); }

  /** BERT's erf GELU of x + bias per row of bias.length values (bias null: one row) -> Float32Array. */
  gelu(x, bias, opts) { return this.#invoke('gelu', [x, bias, opts]); }

  /** x + bias per row of bias.length values -> Float32Array. */
  addBias(x, bias) { return this.#invoke('addBias', [x, bias]); }

  /** x W^T + bias (null for none) for x of m rows of packed.k values -> Float32Array(m * rows):
   * quantizeAct, qmatmul and addBias in one call, bit for bit, the activations never leaving the
   * module's memory. */
  linear(packed, x, bias, opts) { return this.#invoke('linear', [packed, x, bias, opts]); }

  /** LayerNorm of each row (gamma.length values) of x + residual + bias (null for none) -> Float32Array. */
  layerNorm(x, gamma, beta, residual, bias, eps, opts) {
    return this.#invoke('layerNorm', [x, gamma, beta, residual, bias, eps, opts]);
  }

  /** Multi-head self-attention: qkv rows (q | k | v of heads * d values, queries scaled by
   * 1 / sqrt(d)) of sentences of lengths[s] tokens one after another; a query sees only its own
   * sentence's keys -> Float32Array(rows * heads * d). */
  attention(qkv, lengths, heads, opts) { return this.#invoke('attention', [qkv, lengths, heads, opts]); }

  /** Mean over the tokens whose mask is nonzero: x[seqs * t * n], mask[seqs * t] -> Float32Array(seqs * n). */
  meanPool(x, mask, seqs) { return this.#invoke('meanPool', [x, mask, seqs]); }

  /** Each row of n values at unit length -> Float32Array. */
  l2Normalize(x, n) { return this.#invoke('l2Normalize', [x, n]); }

  /** Any export of `kernel` (for `quant`, or null) with raw arguments: numbers as they are, typed
   * arrays copied in (their addresses passed) and back -> {result, arrays}. {threads: true} runs a
   * kernel declared `parallel` through the pool. */
  run(kernel, quant, args, opts) { return this.#invoke('run', [kernel, quant, args, opts]); }

  /** Use k threads (1 .. info.threads) for threaded calls from now on. */
  setThreads(k) { return this.#invoke('setThreads', [k]); }

  /** Run a pool job by its manifest "jobs" name with raw argument words. */
  runJob(job, count, chunk, args) { return this.#invoke('runJob', [job, count, chunk, args]); }

  /** A Float32Array copied into the module's memory to stay there: a held array {held: true, length,
   * ...} that linear, gelu, layerNorm and attention take in place of a Float32Array with no copy
   * (and return with {hold: true}), kept until free(held) or reset(). */
  hold(x) { return this.#invoke('hold', [x]); }

  /** A held array's values -> Float32Array. */
  read(held) { return this.#invoke('read', [held]); }

  /** Give a packed matrix's or a held array's memory back (using it afterwards is a RangeError;
   * freeing again does nothing). */
  free(packedOrHeld) { return this.#invoke('free', [packedOrHeld]); }

  /** Free every buffer, packed weights and held arrays included. */
  reset() { return this.#invoke('reset', []); }

  /** Time `method(...args)` in the driver thread: {iterations, msPerCall, stopped}. */
  bench(method, args, opts) { return this.#invoke('bench', [method, args, opts]); }

  /** Ask a running bench loop to end (from any thread that has this flag); false without shared memory. */
  stop() {
    if (!this.stopFlag) return false;
    Atomics.store(this.stopFlag, 0, 1);
    return true;
  }

  /** Stop the pool's workers (and the driver worker in a browser) and let go of the memory. */
  async terminate() {
    const close = this.#close;
    this.#close = async () => {};
    this.#invoke = () => Promise.reject(new Error('these kernels were terminated'));
    await close();
  }
}
