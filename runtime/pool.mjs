// The thread pool's host side in JavaScript, mirroring kernelgen/host/pool.py.
//
// Each helper is a worker (worker_threads in Node, a Web Worker in a browser) with its own
// instance of the module on the one shared memory, sitting in the exported `pool_helper` loop;
// the driver thread runs jobs through `par_for` (kernels.dsl, "the thread pool"). par_for blocks
// in memory.atomic.wait32, which a browser's main thread may not do: there the driver is itself a
// worker (runtime/worker.mjs). A job is a manifest "jobs" entry, an item count, a chunk size and
// its argument words at JOB_ARGS. A kernel declared `parallel` is called with its own arguments
// (Pool.call): its manifest entry says which job runs it, how the item count follows from the
// arguments and which arguments are the job's words (jobCall, as kernelgen/host/pool.py).
//
// A helper whose job traps writes the message to its slot of an error board (a small shared
// buffer the driver reads synchronously: it cannot take messages while par_for blocks), counts
// itself out with `pool_done` and re-enters its loop; the driver raises JobError once the job is over.

import { I32_MAX, MAX_THREADS, checkArguments, evaluate } from './manifest.mjs';
import { startWorker } from './platform.mjs';

const START_TIMEOUT_MS = 10_000; // as kernelgen/host/pool.py
const STOP_TIMEOUT_MS = 10_000;
const POLL_MS = 1;
const ERROR_SLOT_BYTES = 1024; // one helper's trap message, UTF-8, cut to fit
const MAX_ITEMS = 2 ** 30; // items per job: with the chunk bound in run, the claims stay within an i32
// The pool's own exports (they wait for helpers or run a helper's loop): run by the pool only, as
// POOL_EXPORTS in kernelgen/host/pool.py.
export const POOL_EXPORTS = new Set(['pool_helper', 'pool_done', 'pool_wait', 'par_for', 'pool_stop']);

export class JobError extends Error {
  /** A job trapped on the driver and/or in helpers; the pool is still usable. */
  constructor(message, driverError, helperErrors) {
    super(message);
    this.name = 'JobError';
    this.driverError = driverError;
    this.helperErrors = helperErrors;
  }
}

/** How a call of parallel export `exportName` with `args` (its parameters in order) runs on the
 * pool, from its manifest "parallel" entry: {job, count, words, items}. */
export function jobCall(manifest, exportName, args) {
  const entry = manifest.exports[exportName];
  if (!entry) throw new Error(`no export ${exportName}`);
  const par = entry.parallel;
  if (!par) throw new Error(`${entry.kernel} has no pool job (its kernel has no 'parallel' declaration)`);
  const names = entry.params.map((p) => p.name);
  if (args.length !== names.length) {
    throw new TypeError(`${exportName} takes ${names.length} arguments (${names.join(', ')}), got ${args.length}`);
  }
  const env = Object.fromEntries(names.map((n, i) => [n, args[i]]));
  const words = manifest.jobs[par.job].args.map((a) => env[a.name]);
  // a negative count is no items, as the export itself takes it (its loop runs from 0 to it)
  return { job: par.job, count: Math.max(0, evaluate(par.count, env)), words, items: par.items };
}

/** Items per claim for a jobCall `call` when the caller gives none, on a pool of `threads`: the
 * job's tuned chunk (the manifest's jobs.<job>.tuned, which `kernelgen build` takes from the tuning
 * store) capped at two claims per thread (it was measured on one large shape), else about four
 * claims per thread. As Pool.default_chunk in kernelgen/host/pool.py. */
export function defaultChunk(manifest, call, threads) {
  const tuned = manifest.jobs[call.job].tuned?.chunk;
  if (tuned) return Math.max(1, Math.min(tuned, Math.ceil(call.count / (threads * 2))));
  return Math.max(1, Math.ceil(call.count / (threads * 4)));
}

const sleep = (ms) => new Promise((resolve) => setTimeout(resolve, ms));

/** `promise`'s value, or TIMED_OUT after `ms` (the timer cleared either way: a pending timer
 * would keep Node running). */
const TIMED_OUT = Symbol('timed out');
function within(promise, ms) {
  let timer;
  const timeout = new Promise((resolve) => { timer = setTimeout(resolve, ms, TIMED_OUT); });
  return Promise.race([promise, timeout]).finally(() => clearTimeout(timer));
}

/** The pool words of the manifest's memory.fixed as indices into an Int32Array of the memory. */
function poolWords(memory, fixed) {
  return { i32: new Int32Array(memory.buffer, 0, fixed.JOB_ARGS / 4), at: (name) => fixed[name] / 4 };
}

/** One message slot per helper: an i32 byte length per slot, then the slots' UTF-8 bytes. */
class ErrorBoard {
  constructor(buffer) {
    this.buffer = buffer;
    this.slots = buffer.byteLength / (4 + ERROR_SLOT_BYTES);
    this.lengths = new Int32Array(buffer, 0, this.slots);
    this.bytes = new Uint8Array(buffer, 4 * this.slots);
  }

  static create(helpers) {
    return new ErrorBoard(new SharedArrayBuffer(helpers * (4 + ERROR_SLOT_BYTES)));
  }

  write(id, message) {
    // Encoded apart and copied: browsers' TextEncoder/TextDecoder refuse views of shared memory.
    const bytes = new TextEncoder().encode(message).subarray(0, ERROR_SLOT_BYTES);
    this.bytes.set(bytes, id * ERROR_SLOT_BYTES);
    Atomics.store(this.lengths, id, bytes.length); // published to the driver by pool_done's atomic sub
  }

  /** The messages written since the last take, clearing them. */
  take() {
    const out = [];
    for (let id = 0; id < this.slots; id++) {
      const n = Atomics.exchange(this.lengths, id, 0);
      if (n) {
        const slot = this.bytes.slice(id * ERROR_SLOT_BYTES, id * ERROR_SLOT_BYTES + n);
        out.push(`helper ${id}: ${new TextDecoder().decode(slot)}`);
      }
    }
    return out;
  }
}

/**
 * A helper thread's life (in runtime/worker.mjs): its own instance on the shared memory, then
 * pool_helper until POOL_STOP. Mirrors Pool._helper in kernelgen/host/pool.py.
 */
export async function runHelper({ id, module, memory, fixed, board }) {
  const { exports } = await WebAssembly.instantiate(module, { env: { memory } });
  const errors = new ErrorBoard(board);
  const words = poolWords(memory, fixed);
  let rejoin = 0;
  let last = 0;
  for (;;) {
    try {
      exports.pool_helper(id, rejoin, last);
      return; // POOL_STOP was set
    } catch (e) {
      // Whatever ended the call (a trap, a stack overflow), this helper left the job: it must
      // count itself out or the driver would wait for it forever.
      errors.write(id, String(e?.message ?? e));
      // The failed job's generation: no other job can be published before pool_done() below,
      // and the helper must take part in any published after it.
      last = Atomics.load(words.i32, words.at('POOL_GEN'));
      exports.pool_done();
      rejoin = 1;
    }
  }
}

export class Pool {
  /** `threads` threads in all: the calling thread (the driver) and threads - 1 helper workers. */
  static async start({ module, memory, manifest, exports, threads }) {
    if (typeof threads !== 'number') throw new TypeError(`threads: expected a thread count (a number), got ${typeof threads}`);
    if (!Number.isInteger(threads) || threads < 1 || threads > MAX_THREADS) {
      throw new RangeError(`threads must be 1..${MAX_THREADS}, got ${threads}`);
    }
    const pool = new Pool(module, memory, manifest, exports, threads);
    await pool.#startHelpers();
    return pool;
  }

  #words;
  #module;
  #memory;
  #exports;
  #board = null;
  #helpers = []; // {worker, exited: Promise}
  #closing = false;
  #lost = null; // why a helper is gone while the pool runs: its jobs would wait for it forever

  constructor(module, memory, manifest, exports, threads) {
    this.#module = module;
    this.#memory = memory;
    this.#exports = exports;
    this.manifest = manifest;
    this.size = threads;
    this.#words = poolWords(memory, manifest.memory.fixed);
  }

  #load(name) { return Atomics.load(this.#words.i32, this.#words.at(name)); }
  #store(name, value) { Atomics.store(this.#words.i32, this.#words.at(name), value); }

  async #startHelpers() {
    if (this.#load('POOL_READY') !== 0) throw new Error("this module's memory already has a pool (close it first)");
    this.#store('POOL_STOP', 0);
    this.#store('POOL_WANT', this.size - 1);
    if (this.size === 1) return;
    this.#board = ErrorBoard.create(this.size - 1);
    let failure = null;
    for (let id = 0; id < this.size - 1; id++) {
      const worker = startWorker(`kernelgen-pool-${id}`);
      const exited = new Promise((resolve) => {
        worker.onMessage((m) => {
          if (m.type === 'failed') failure ??= new Error(`pool helper ${id}: ${m.message}`);
          resolve(); // 'exited' or 'failed': either way it is not in pool_helper
        });
        worker.onExit((code) => { // a helper gone (killed, out of memory) while the pool runs
          if (!this.#closing) this.#lost ??= `pool helper ${id} stopped (exit code ${code})`;
          resolve();
        });
      });
      worker.onError((e) => { failure ??= e; this.#lost ??= `pool helper ${id} failed (${e?.message ?? e})`; });
      worker.post({ role: 'helper', id, module: this.#module, memory: this.#memory,
        fixed: this.manifest.memory.fixed, board: this.#board.buffer });
      this.#helpers.push({ worker, exited });
    }
    const deadline = performance.now() + START_TIMEOUT_MS;
    while (this.#load('POOL_READY') < this.size - 1) {
      if (failure || performance.now() > deadline) {
        const ready = this.#load('POOL_READY');
        await this.close().catch(() => {});
        throw failure ?? new Error(`pool: only ${ready} of ${this.size - 1} helpers started`);
      }
      await sleep(POLL_MS);
    }
  }

  /** Use `threads` threads (1 .. the pool's size) from the next job on. */
  setThreads(threads) {
    if (typeof threads !== 'number') throw new TypeError(`setThreads: expected a thread count (a number), got ${typeof threads}`);
    if (!Number.isInteger(threads) || threads < 1 || threads > this.size) {
      throw new RangeError(`setThreads(${threads}): this pool has ${this.size} threads`);
    }
    this.#store('POOL_WANT', threads - 1);
  }

  /** Run parallel export `exportName` with its own arguments, `chunk` items per claim (default:
   * the job's tuned chunk, else about four claims per thread; run refuses a bad one). */
  call(exportName, args, chunk) {
    const c = jobCall(this.manifest, exportName, args);
    checkArguments(exportName, this.manifest.exports[exportName], args, this.#memory.buffer.byteLength, [],
      (i, offset) => new DataView(this.#memory.buffer, args[i]).getInt32(offset, true));
    this.run(c.job, c.count, chunk ?? defaultChunk(this.manifest, c, this.size), c.words);
  }

  /** Run job `job` (a manifest "jobs" name) on items 0 .. count - 1, `chunk` items per claim.
   * count is 0 .. 2^30; chunk is 1 .. 2^31 - 1, used as given up to the bound that keeps POOL_NEXT
   * (advanced by a chunk by every thread once past the end) within an i32: a larger chunk changes
   * only how the items are split, never a result. */
  run(job, count, chunk, args) {
    const jobs = this.manifest.jobs;
    if (typeof job !== 'string' || !Object.hasOwn(jobs, job)) throw new TypeError(`no job ${JSON.stringify(job)}; jobs: ${Object.keys(jobs).join(', ')}`);
    const spec = jobs[job];
    if (this.#exports === null) throw new Error('pool is closed');
    if (this.#lost) throw new Error(`${this.#lost}: its jobs would wait for it forever; terminate these kernels and load them again`);
    if (!Array.isArray(args) || args.length !== spec.args.length) {
      throw new TypeError(`${job} takes ${spec.args.length} arguments (${spec.args.map((a) => a.name).join(', ')}), got ${args?.length}`);
    }
    if (!Number.isInteger(count) || count < 0 || count > MAX_ITEMS || !Number.isInteger(chunk) || chunk < 1 || chunk > I32_MAX) {
      throw new RangeError(`${job}: need integers count in 0..${MAX_ITEMS} and chunk in 1..${I32_MAX}, got count=${count}, chunk=${chunk}`);
    }
    chunk = Math.min(chunk, Math.max(1, Math.floor((I32_MAX - count) / (this.size + 1))));
    const heapBase = this.manifest.memory.heap_base;
    const end = this.#memory.buffer.byteLength;
    spec.args.forEach((a, slot) => {
      const v = args[slot];
      const ok = a.type === 'f32' ? typeof v === 'number' : Number.isInteger(v) && v >= -(2 ** 31) && v < 2 ** 32;
      if (!ok) throw new TypeError(`${job} ${a.name}: expected ${a.type === 'f32' ? 'a number' : 'a 32-bit integer'}, got ${v}`);
      // Below heap_base are the pool's own words: a job writing there would hang the next one.
      if (a.dsl_type === 'ptr' && (v < heapBase || v >= end)) {
        throw new RangeError(`${job} ${a.name}: address ${v} is outside the heap (${heapBase} .. ${end - 1}: below it are the`
          + " pool's words, past it an i32 address wraps onto them)");
      }
    });
    const { JOB_ARGS } = this.manifest.memory.fixed;
    const nwords = this.manifest.memory.job_arg_words;
    const ints = new Int32Array(this.#memory.buffer, JOB_ARGS, nwords);
    const floats = new Float32Array(this.#memory.buffer, JOB_ARGS, nwords);
    spec.args.forEach((a, slot) => { (a.type === 'f32' ? floats : ints)[slot] = args[slot]; });
    this.#board?.take(); // nothing stale from an earlier job
    let driverError = null;
    try {
      this.#exports.par_for(spec.index, count, chunk);
    } catch (e) {
      driverError = e;
      this.#exports.pool_wait(); // the helpers finish the job before anyone starts another
    }
    const helperErrors = this.#board?.take() ?? [];
    if (driverError || helperErrors.length) {
      const where = [driverError && 'the driver thread', helperErrors.length && `${helperErrors.length} helper thread(s)`]
        .filter(Boolean).join(' and ');
      const first = driverError?.message ?? helperErrors[0];
      throw new JobError(`${job} trapped in ${where}: ${first}`, driverError?.message ?? null, helperErrors);
    }
  }

  /** Stop the helpers (pool_stop wakes them; each leaves its loop and says so), end their
   * workers, and zero POOL_READY so that the memory can get a new pool. */
  async close() {
    if (this.#exports === null) return;
    const helpers = this.#helpers;
    this.#helpers = [];
    this.#closing = true;
    let stuck = false;
    if (helpers.length) {
      this.#exports.pool_stop();
      stuck = await within(Promise.all(helpers.map((h) => h.exited)), STOP_TIMEOUT_MS) === TIMED_OUT;
      await Promise.all(helpers.map((h) => h.worker.terminate()));
    }
    this.#store('POOL_READY', 0);
    this.#exports = null;
    if (stuck) throw new Error('pool: helpers did not leave pool_helper in time and were terminated');
  }
}
