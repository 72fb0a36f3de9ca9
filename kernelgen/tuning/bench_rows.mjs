// `kernelgen bench --engine node|chromium`: the mat-vec and GEMM rows run in V8 through the JS
// runtime, as a model runs them. benchRows(config) runs them in Node (node_bench.mjs) or in a page of
// headless Chromium (chromium_bench.mjs), with config {out, target, seed, runtime, cases: [{quant,
// shape: [rows, cols], twoThreads}], gemms: [{kernel, quant, shape: [m, n, k], pool: [threads...]}],
// rooflines: [{op, iters, seed, exports}], streams: [job...], minMs}: `out` the URL of a build directory holding the bench module (the library
// plus the streaming reads' pool jobs, `streams`: one per interleaved-stream count), `seed` the URL
// of the seed-style peer's wasm, `runtime` the URL of runtime/kernelgen.mjs (kernelgen.library.runtime():
// the checkout's, or the copy an installed wheel carries; file: URLs in Node, the page's server's in
// Chromium). Resolves to {target, flavor (the build the runtime chose: null for the base), rows: [{kernel,
// quant, shape, threads, seconds}]},
// kernel one of qmatvec (the exported kernel), qmatvec pool (its job on the pool), seed, stream, and
// for each GEMM case (qmatmul: Y = A W^T of m tokens; matmul_f32_nt: a b^T, b n x k; matmul_f32_nn:
// a b, b k x n) the kernel on the calling thread and "<kernel> pool" on each of its thread counts;
// "roofline" (quant: its op, shape: [iters]) the fastest of a compute roofline's register-only loops
// (`exports`, one per accumulator count), each called as export(iters, seed).
//
// Every time is per call of the runtime's API (Kernels.bench: activations copied in, y copied out,
// as a model runs it), except the peer's, which is called directly on a memory laid out as the
// runtime's: its weights at the addresses the runtime packed them (seedPeer). The one-thread mat-vec
// rows of all cases (qmatvec, stream, seed) are timed in turn (inTurn), as bench.py times the rows a
// ratio compares.

const STREAM_CHUNK = 1 << 16; // the streaming reads' item, bytes (kernelgen/tuning/timing.py)

/** A seeded generator (xorshift32): the same inputs every run. */
function generator(seed) {
  let s = seed >>> 0 || 1;
  return () => {
    s ^= s << 13; s >>>= 0;
    s ^= s >>> 17;
    s ^= s << 5; s >>>= 0;
    return s;
  };
}

/** Stored blocks of `quant` with random codes, every f16 scale field 0.01 and every byte field of the scale the
 * value whose scale is nearest 0.01 (as bench.py makes them). */
function blocksOf(spec, rows, cols, rand, packPlanes) {
  const nblocks = rows * (cols / spec.block);
  const bytes = new Uint8Array(nblocks * spec.stored_bytes);
  for (let i = 0; i < bytes.length; i += 4) {
    const r = rand();
    bytes[i] = r; bytes[i + 1] = r >>> 8; bytes[i + 2] = r >>> 16; bytes[i + 3] = r >>> 24;
  }
  const f16 = spec.fields.filter((f) => f.type === 'f16');
  for (let b = 0; b < nblocks; b++) {
    for (const f of f16) {
      const at = b * spec.stored_bytes + f.offset;
      bytes[at] = 0x1f; bytes[at + 1] = 0x21; // 0.01 in f16, little-endian
    }
  }
  // a byte field of the scale (an e8m0 exponent): the value whose scale is nearest 0.01, found by
  // packing the first block with each of the 256 values (random exponents: subnormal/inf products)
  for (const f of scaleBytes(spec)) {
    const trial = new Uint8Array(256 * spec.stored_bytes);
    for (let v = 0; v < 256; v++) {
      trial.set(bytes.subarray(0, spec.stored_bytes), v * spec.stored_bytes);
      trial[v * spec.stored_bytes + f.offset] = v;
    }
    const { scale } = packPlanes(spec, trial, 256, spec.block); // 256 rows of one block: row v's scale first of its per
    const per = scale.length / 256;
    const off = (v) => Math.abs(Math.log2(Math.abs(scale[v * per])) - Math.log2(0.01));
    let best = 0;
    for (let v = 1; v < 256; v++) if (Number.isFinite(off(v)) && !(off(v) >= off(best))) best = v;
    for (let b = 0; b < nblocks; b++) bytes[b * spec.stored_bytes + f.offset] = best;
  }
  return bytes;
}

/** The scalar byte fields the scale formula reads. */
function scaleBytes(spec) {
  const names = new Set();
  const walk = (t) => { if (t.kind === 'field') names.add(t.field); (t.args ?? []).forEach(walk); };
  walk(spec.formulas.scale);
  return spec.fields.filter((f) => names.has(f.name) && (f.type === 'u8' || f.type === 'i8') && f.count === null);
}

function normals(n, rand) {
  const x = new Float32Array(n);
  for (let i = 0; i < n; i++) {
    const u = (rand() + 1) / 4294967297, v = rand() / 4294967296;
    x[i] = Math.sqrt(-2 * Math.log(u)) * Math.cos(2 * Math.PI * v);
  }
  return x;
}

/** The seed-style peer on a shared memory made as the runtime makes its module's (the manifest's
 * pages), the q8_0 planes at the very addresses the runtime packed them (`w.planes`): the same bytes
 * at the same placement, so a ratio against it measures the kernels, not where each buffer sits.
 * Its own buffers follow the planes. */
async function seedPeer(wasmBytes, manifest, spec, w, blocks, x, packPlanes) {
  const { rows, k: cols } = w;
  const planes = packPlanes(spec, blocks, rows, cols);
  let top = Math.max(...Object.entries(planes).map(([n, p]) => w.planes[n] + p.byteLength));
  const bytes = top + cols * 3 + (cols / 32) * 4 + rows * 4 + 1024;
  const { min_pages: initial, max_pages: maximum } = manifest.memory;
  const memory = new WebAssembly.Memory({ initial, maximum, shared: true });
  memory.grow(Math.max(0, Math.ceil(bytes / 65536) - initial));
  const { instance } = await WebAssembly.instantiate(wasmBytes, { env: { memory } });
  const at = (addr, arr) => {
    new Uint8Array(memory.buffer, addr, arr.byteLength).set(new Uint8Array(arr.buffer, arr.byteOffset, arr.byteLength));
    return addr;
  };
  const alloc = (n) => { const a = Math.ceil(top / 64) * 64; top = a + n; return a; };
  const put = (arr) => at(alloc(arr.byteLength), arr);
  // int8 activations as simd128's quantize_act makes them: d = amax / 127, q = round(x / d)
  const aq = new Int8Array(cols), ad = new Float32Array(cols / 32);
  for (let b = 0; b < cols / 32; b++) {
    let amax = 0;
    for (let i = 0; i < 32; i++) amax = Math.max(amax, Math.abs(x[b * 32 + i]));
    const d = Math.fround(amax / 127);
    ad[b] = d;
    for (let i = 0; i < 32; i++) aq[b * 32 + i] = d ? Math.max(-127, Math.min(127, Math.round(x[b * 32 + i] / d))) : 0;
  }
  const args = [at(w.planes.q, planes.q), at(w.planes.scale, planes.scale), put(aq), put(ad), alloc(2 * cols), alloc(4 * rows), rows, cols];
  const y = () => new Float32Array(memory.buffer, args[5], rows).slice();
  return { call: () => instance.exports.seed_qmatvec(...args), y };
}

/** Milliseconds per call of fn over calls for about ms. */
function batchMs(fn, ms) {
  const start = performance.now();
  let n = 0, now = start;
  while (n === 0 || now - start < ms) { fn(); n++; now = performance.now(); }
  return (now - start) / n;
}

/** Milliseconds per call of fn: a warm-up, then calls for about minMs. */
function timeIt(fn, minMs) {
  batchMs(fn, minMs / 4);
  return batchMs(fn, minMs);
}

/** Milliseconds per call of each of `timers` (timer(ms) -> ms per call over a batch of about ms), their
 * batches taken in turn (timing.measure_together's protocol): a warm-up batch of each, then `rounds`
 * rounds of one batch of minMs / rounds each, every round starting one timer later; each timer's median. */
async function inTurn(timers, minMs, rounds = 5) {
  for (const timer of timers) await timer(minMs / 4);
  const samples = timers.map(() => []);
  for (let r = 0; r < rounds; r++) {
    for (let j = 0; j < timers.length; j++) {
      const i = (r + j) % timers.length;
      samples[i].push(await timers[i](minMs / rounds));
    }
  }
  return samples.map((xs) => xs.sort((a, b) => a - b)[xs.length >> 1]);
}

/** The rows `config` asks for (see the top of this file), timed in this engine. */
export async function benchRows(config) {
  const { loadKernels, packPlanes } = await import(config.runtime);
  const { readBytes } = await import(new URL('./platform.mjs', config.runtime));
  const minMs = config.minMs ?? 300;
  const k = await loadKernels({ baseUrl: config.out, target: config.target, threads: 2 });
  const seedWasm = await readBytes(new URL(config.seed));
  try {
    const rows = [];
    const row = (kernel, quant, shape, threads, seconds) => rows.push({ kernel, quant, shape: shape.join('x'), threads, seconds });
    // Every case's weights packed first; then the one-thread rows (qmatvec, the streaming read and the
    // seed-style peer of every case) timed in turn (inTurn), so a ratio of two of them shares the
    // host's drift; then the pool's rows on one and two threads, one after another (batches on every
    // core slow the one-thread batches taken in turn with them: bench.py's Case.alone).
    const single = []; // {kernel, quant, shape, timers: [(ms) -> ms per call], scale}: the fastest timer counts
    const pooled = [];
    for (const { quant, shape, twoThreads } of config.cases) {
      const spec = k.manifest.quants[quant];
      const [r, c] = shape;
      const rand = generator(r * 31 + c);
      const blocks = blocksOf(spec, r, c, rand, packPlanes);
      const x = normals(c, rand);
      const w = await k.pack(quant, blocks, r, c);
      const act = await k.quantizeAct(x);
      const bench = (method, args) => async (ms) => (await k.bench(method, args, { minMs: ms, warmupMs: 0 })).msPerCall;
      single.push({ kernel: 'qmatvec', quant, shape, timers: [bench('qmatvec', [w, act])], scale: 1 });
      const nbytes = Object.values(spec.planes).reduce((s, p) => s + p.bytes_per_block, 0) * r * (c / 32);
      if (nbytes < STREAM_CHUNK) throw new RangeError(`${quant} ${r}x${c}: the streaming read needs at least ${STREAM_CHUNK} bytes of planes`);
      const chunks = Math.floor(nbytes / STREAM_CHUNK);
      const streamArgs = [Object.values(w.planes)[0], chunks * STREAM_CHUNK]; // the planes lie one after another from planes.q
      // the fastest of the read's interleaved-stream counts (config.streams: one pool job each, timing.STREAM_WAYS)
      const stream = { kernel: 'stream', quant, shape, scale: nbytes / (chunks * STREAM_CHUNK),
        timers: config.streams.map((job) => bench('run', [job, null, streamArgs, { threads: true, chunk: 1 }])) };
      single.push(stream);
      if (quant === 'q8_0') {
        const peer = await seedPeer(seedWasm, k.manifest, spec, w, blocks, x, packPlanes);
        peer.call();
        const want = await k.qmatvec(w, act);
        const got = peer.y();
        let err = 0, mag = 0;
        for (let i = 0; i < r; i++) { err = Math.max(err, Math.abs(got[i] - want[i])); mag = Math.max(mag, Math.abs(want[i])); }
        if (!(err <= 0.03 * mag)) throw new Error(`seed-style peer differs from qmatvec at ${r}x${c}: ${err} of ${mag}`);
        single.push({ kernel: 'seed', quant, shape, timers: [async (ms) => batchMs(peer.call, ms)], scale: 1 });
      }
      if (twoThreads) pooled.push({ quant, shape, w, act, stream });
    }
    await k.setThreads(1);
    const times = await inTurn(single.flatMap((s) => s.timers), minMs);
    for (const { kernel, quant, shape, timers, scale } of single) {
      row(kernel, quant, shape, 1, Math.min(...times.splice(0, timers.length)) * scale / 1e3);
    }
    for (const { quant, shape, w, act, stream } of pooled) { // the pool's job on one thread, then on two
      for (const threads of [1, 2]) {
        await k.setThreads(threads);
        row('qmatvec pool', quant, shape, threads, (await k.bench('qmatvec', [w, act, { threads: true, chunk: 16 }], { minMs })).msPerCall / 1e3);
        if (threads > 1) { // (on one thread: the row timed in turn above)
          const ways = [];
          for (const timer of stream.timers) { await timer(minMs / 4); ways.push(await timer(minMs)); }
          row('stream', quant, shape, threads, Math.min(...ways) * stream.scale / 1e3);
        }
      }
    }
    await k.reset();
    /** A timer of GEMM case `kernel` (qmatmul, matmul_f32_nt or matmul_f32_nn): opts -> seconds per API
     * call, its inputs made (and the weights packed) once. */
    async function gemmTimer(kernel, quant, [m, n, kk]) {
      const rand = generator(m * 31 + n * 7 + kk);
      if (kernel === 'qmatmul') {
        const w = await k.pack(quant, blocksOf(k.manifest.quants[quant], n, kk, rand, packPlanes), n, kk);
        const act = await k.quantizeAct(normals(m * kk, rand), m);
        return async (opts) => (await k.bench('qmatmul', [w, act, opts], { minMs })).msPerCall / 1e3;
      }
      const form = { matmul_f32_nt: 'nt', matmul_f32_nn: 'nn' }[kernel];
      if (!form) throw new RangeError(`bench: no GEMM case ${kernel}`);
      const a = normals(m * kk, rand), b = normals(n * kk, rand);
      return async (opts) => (await k.bench('matmulF32', [a, b, m, n, { ...opts, bTransposed: form === 'nt' }], { minMs })).msPerCall / 1e3;
    }

    for (const { kernel, quant, shape, pool } of config.gemms ?? []) {
      const time = await gemmTimer(kernel, quant, shape);
      await k.setThreads(1);
      row(kernel, quant, shape, 1, await time({}));
      for (const threads of pool) {
        await k.setThreads(threads);
        row(`${kernel} pool`, quant, shape, threads, await time({ threads: true }));
      }
      await k.reset();
    }
    if (config.rooflines?.length) {
      // the bench module's own loops, called directly (nothing of the runtime's in the way)
      const { min_pages: initial, max_pages: maximum } = k.manifest.memory;
      const memory = new WebAssembly.Memory({ initial, maximum, shared: true });
      const wasm = await readBytes(new URL(`${config.target}/kernels.wasm`, config.out));
      const { instance } = await WebAssembly.instantiate(wasm, { env: { memory } });
      for (const { op, iters, seed, exports } of config.rooflines) {
        const ms = Math.min(...exports.map((name) => timeIt(() => instance.exports[name](iters, seed), minMs)));
        row('roofline', op, [iters], 1, ms / 1e3);
      }
    }
    return { target: k.info.target, flavor: k.info.flavor, rows };
  } finally {
    await k.terminate();
  }
}
