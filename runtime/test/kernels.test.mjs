// The runtime in Node: the pool (threaded = one thread, traps, stop, shutdown), argument checks,
// and, with KERNELGEN_VECTORS set (tests/test_js.py writes them), every kernel bit-identical to
// wasmtime on both targets. Run: node --experimental-wasm-relaxed-simd --no-liftoff --test runtime/test/

import assert from 'node:assert/strict';
import { createHash } from 'node:crypto';
import { cp, mkdtemp, readFile, rm, writeFile } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { after, before, describe, test } from 'node:test';
import { Worker } from 'node:worker_threads';

import { chooseFlavor } from '../driver.mjs';
import { JobError, loadKernels, probeRelaxedDot } from '../kernelgen.mjs';
import { halfToFloat } from '../pack.mjs';
import { defaultChunk, jobCall } from '../pool.mjs';
import { firstDifference, runVectors } from '../testing/vectors.mjs';
import { random } from '../testing/random.mjs';

const VECTORS = process.env.KERNELGEN_VECTORS;
const THREADS = 3;
const probe = await probeRelaxedDot();
const TARGETS = [['simd128', null], ['relaxed-simd', probe.usable ? null : probe.note]];
const FLAVORS = Object.fromEntries(await Promise.all(TARGETS.map(async ([target]) => [target, Object.keys(JSON.parse(
  await readFile(new URL(`../../out/${target}/kernels.json`, import.meta.url), 'utf8')).flavors ?? {})])));

function normals(rand, n) {
  return Float32Array.from({ length: n }, () => (rand() / 2 ** 32 - 0.5) * 6);
}

/** Plausible stored blocks of any quant type from its manifest fields: small positive scales,
 * zero points within a nibble, random value bytes. */
function randomBlocks(spec, nblocks, rand) {
  const bytes = new Uint8Array(nblocks * spec.stored_bytes);
  const view = new DataView(bytes.buffer);
  for (let b = 0; b < nblocks; b++) {
    for (const f of spec.fields) {
      const at = b * spec.stored_bytes + f.offset;
      if (f.type === 'f16') view.setUint16(at, 0x2000 | (rand() & 0x3ff), true); // about 0.008 to 0.016
      else if (f.type === 'f32') view.setFloat32(at, 0.01 * (1 + (rand() & 0xff) / 256), true);
      else if (f.count === null) view.setUint8(at, rand() & 15);
      else for (let i = 0; i < f.count; i++) view.setUint8(at + i, rand() & 0xff);
    }
  }
  return bytes;
}

test('halfToFloat decodes normals, subnormals, zeros, infinities and NaN', () => {
  const cases = [[0x3c00, 1], [0xc000, -2], [0x7bff, 65504], [0x0001, 2 ** -24], [0x8000, -0], [0x7c00, Infinity], [0xfc00, -Infinity]];
  for (const [bits, want] of cases) assert.ok(Object.is(halfToFloat(bits), want), `0x${bits.toString(16)}`);
  assert.ok(Number.isNaN(halfToFloat(0x7e00)));
});

test('a job called without a chunk takes the manifest\'s tuned chunk (at most two claims per thread), else about four claims per thread', async () => {
  for (const target of ['simd128', 'relaxed-simd']) {
    const manifest = JSON.parse(await readFile(new URL(`../../out/${target}/kernels.json`, import.meta.url), 'utf8'));
    const name = Object.keys(manifest.exports).find((e) => manifest.exports[e].kernel === 'matvec_f32');
    const call = jobCall(manifest, name, [0, 0, 0, 1000, 64]); // 1000 rows of 64
    const job = manifest.jobs[call.job];
    delete job.tuned;
    assert.equal(defaultChunk(manifest, call, 3), Math.ceil(1000 / 12));
    job.tuned = { threads: 2, chunk: 37 };
    assert.equal(defaultChunk(manifest, call, 3), 37);
    job.tuned = { threads: 2, chunk: 512 }; // capped at two claims per thread: 1000 / 6
    assert.equal(defaultChunk(manifest, call, 3), Math.ceil(1000 / 6));
  }
});

test('probeRelaxedDot says what the engine does with the 7-bit operand', (t) => {
  t.diagnostic(JSON.stringify(probe));
  assert.equal(typeof probe.supported, 'boolean');
  if (probe.usable) assert.ok(['signed', 'unsigned', 'unknown'].includes(probe.sevenBit));
  else assert.match(probe.note, /./);
});

test('chooseFlavor takes the first flavor whose probe outcome matches, the one asked for, or the base build', () => {
  const when = { sevenBit: 'unsigned', saturates: false };
  const manifest = { flavors: { vnni: { dir: 'vnni', when, why: 'fused' } } };
  const vnni = { usable: true, sevenBit: 'unsigned', saturates: false };
  assert.deepEqual(chooseFlavor(manifest, undefined, vnni), { flavor: 'vnni', dir: 'vnni', why: 'fused' });
  assert.deepEqual(chooseFlavor(manifest, 'auto', vnni), { flavor: 'vnni', dir: 'vnni', why: 'fused' });
  const others = [{ sevenBit: 'unsigned', saturates: true }, { sevenBit: 'signed', saturates: false }, { supported: false }];
  for (const other of others) {
    assert.equal(chooseFlavor(manifest, 'auto', other).flavor, null, JSON.stringify(other));
    assert.equal(chooseFlavor(manifest, 'vnni', other).flavor, 'vnni', 'asked for: loaded whatever the probe says');
  }
  assert.equal(chooseFlavor(manifest, 'base', vnni).flavor, null);
  assert.equal(chooseFlavor({}, 'auto', vnni).flavor, null, 'a manifest without flavors');
  assert.throws(() => chooseFlavor(manifest, 'avx512', vnni), /one of this build's flavors \(vnni\)/);
  assert.throws(() => chooseFlavor(manifest, 3, vnni), TypeError);
});

/** kernels.json's text for `manifest`, signed as a build signs it (kernelgen/host/manifest.py
 * manifest_text): the last key the sha256 of the text with that value as 64 zeros. */
function signed(manifest) {
  const { manifest_sha256: _, ...body } = manifest;
  const zeros = `${JSON.stringify({ ...body, manifest_sha256: '0'.repeat(64) }, null, 2)}\n`;
  return zeros.replace(/0{64}"\n}\n$/, `${createHash('sha256').update(zeros).digest('hex')}"\n}\n`);
}

test('a flavor the probe picks but which is not deployed gives way to the base build, with a note; asked for, it is an error', {
  skip: probe.usable ? false : probe.note,
}, async () => {
  const dir = await mkdtemp(join(tmpdir(), 'kernelgen-flavor-'));
  try {
    await cp(new URL('../../out/relaxed-simd/', import.meta.url), join(dir, 'relaxed-simd'), { recursive: true });
    const manifest = JSON.parse(await readFile(join(dir, 'relaxed-simd', 'kernels.json'), 'utf8'));
    manifest.flavors = { ghost: { dir: 'ghost', when: Object.fromEntries(['sevenBit', 'saturates'].map((f) => [f, probe[f]])) } };
    await writeFile(join(dir, 'relaxed-simd', 'kernels.json'), signed(manifest));
    const k = await loadKernels({ dir, target: 'relaxed-simd', threads: 1 });
    try {
      assert.equal(k.info.flavor, null);
      assert.match(k.info.notes.join('\n'), /the ghost flavor suits this engine, but .*ghost\/kernels\.(json|wasm): cannot read it/);
    } finally {
      await k.terminate();
    }
    await assert.rejects(loadKernels({ dir, target: 'relaxed-simd', flavor: 'ghost', threads: 1 }), /ghost\/kernels\.(json|wasm): cannot read it/);
  } finally {
    await rm(dir, { recursive: true, force: true });
  }
});

test('a manifest edited after its build is refused: unsigned, or signed again but not matching its wasm', async () => {
  const cases = [
    [(m) => { m.activation.max = 126; }, /edited after its build \(its manifest_sha256 is not the sha256 of its text\)/,
      (m) => `${JSON.stringify(m, null, 2)}\n`], // the old signature kept
    [(m) => { m.activation.max = 126; }, /not signed by its build/, JSON.stringify],
    [(m) => { [m.exports.exp_f32, m.exports.silu_f32] = [m.exports.silu_f32, m.exports.exp_f32]; },
      /exports\.exp_f32 names kernel "silu_f32", quant null and tune \{\}, whose export is not "exp_f32"/],
    [(m) => { m.quants.q4_0.planes = null; }, /quants\.q4_0 must give a block, a group of rows and its planes/],
    [(m) => { m.exports.matvec_f32__unroll4.parallel.job = Object.keys(m.jobs).find((j) => m.jobs[j].kernel === 'silu_f32_job'); },
      /exports\.matvec_f32__unroll4\.parallel must give its items and name a job of matvec_f32/],
    [(m) => { m.exports.exp_f32.params.shift(); }, /exports\.exp_f32 gives 2 parameters, the wasm function takes 3/],
  ];
  const dir = await mkdtemp(join(tmpdir(), 'kernelgen-tampered-'));
  try {
    for (const [edit, message, write = signed] of cases) {
      await cp(new URL('../../out/simd128/', import.meta.url), join(dir, 'simd128'), { recursive: true });
      const manifest = JSON.parse(await readFile(join(dir, 'simd128', 'kernels.json'), 'utf8'));
      edit(manifest);
      await writeFile(join(dir, 'simd128', 'kernels.json'), write(manifest));
      await assert.rejects(loadKernels({ dir, target: 'simd128', threads: 1 }), message);
    }
  } finally {
    await rm(dir, { recursive: true, force: true });
  }
});

test('loadKernels picks relaxed SIMD exactly where its dot is usable, and says why', async () => {
  const k = await loadKernels({ threads: 1 });
  try {
    assert.equal(k.info.target, probe.usable ? 'relaxed-simd' : 'simd128');
    assert.match(k.info.targetReason, /./);
    assert.deepEqual(k.info.relaxedDot, probe);
    assert.equal(k.info.flavor, k.info.target === 'relaxed-simd'
      ? chooseFlavor(k.manifest, 'auto', probe).flavor : null, k.info.flavorReason);
    assert.equal(k.info.threads, 1);
  } finally {
    await k.terminate();
  }
});

for (const [target, unusable] of TARGETS) {
  describe(`${target}, ${THREADS} threads`, { skip: unusable ?? false }, () => {
    let k;
    before(async () => { k = await loadKernels({ target, threads: THREADS }); });
    after(async () => { await k?.terminate(); });

    test('every threaded kernel equals its one-thread run at 1..n threads', async () => {
      const rand = random(7);
      const kdim = 1280; // whole blocks of every type (256 for super-blocks)
      const act = await k.quantizeAct(normals(rand, kdim));
      const x = normals(rand, 1003);
      const g = normals(rand, 1003);
      const scores = normals(rand, 11 * 32);
      const heads = normals(rand, 6 * 64);
      const { cos, sin } = await k.ropeTable(1, 64);
      const wf = normals(rand, 13 * 70);
      const xf = normals(rand, 70);
      const calls = {
        matvecF32: (o) => k.matvecF32(wf, xf, o),
        softmax: (o) => k.softmax(scores, 29, 32, o),
        silu: (o) => k.silu(x, o),
        swiglu: (o) => k.swiglu(x, g, o),
        'rope halves': (o) => k.rope(heads, cos, sin, o),
        'rope pairs': (o) => k.rope(heads, cos, sin, { ...o, interleaved: true }),
        gelu: (o) => k.gelu(xf.subarray(0, 68), xf.subarray(0, 4), o),
        layerNorm: (o) => k.layerNorm(xf.subarray(0, 68), xf.subarray(0, 4), xf.subarray(4, 8), null, null, 1e-5, o),
      };
      for (const [quant, spec] of Object.entries(k.manifest.quants)) {
        const w = await k.pack(quant, randomBlocks(spec, 23 * kdim / spec.block, rand), 23, kdim);
        calls[`qmatvec ${quant}`] = (o) => k.qmatvec(w, act, o);
      }
      for (const [name, call] of Object.entries(calls)) {
        const want = await call({});
        for (let threads = 1; threads <= THREADS; threads++) {
          await k.setThreads(threads);
          for (const chunk of [undefined, 1]) {
            const got = await call({ threads: true, chunk });
            assert.equal(firstDifference(got, want), null, `${name} at ${threads} threads, chunk ${chunk}`);
          }
        }
      }
      await k.setThreads(THREADS);
    });

    test('misuse found by fuzzing is refused, and the kernels compute on', async () => {
      const rand = random(5);
      const w = await k.pack('q4_1', randomBlocks(k.manifest.quants.q4_1, 2 * 2, rand), 2, 64);
      const act = await k.quantizeAct(normals(rand, 64));
      const want = await k.qmatvec(w, act);
      const held = await k.hold(new Float32Array(8));
      const matvecJob = Object.keys(k.manifest.jobs).find((name) => k.manifest.jobs[name].kernel === 'matvec_f32_job');
      const lying = new Float32Array(1);
      Object.defineProperty(lying, 'length', { value: 64 });
      const misuse = [
        [() => k.addBias(held, new Float32Array(4)), TypeError, /addBias x: expected a Float32Array/],
        [() => k.free({ ...held, addr: w.planes.q }), TypeError, /fields were changed/],
        [() => k.qmatvec({ ...w, rows: 8 }, act), TypeError, /fields were changed/],
        [() => k.read({ ...held, length: 4096 }), TypeError, /fields were changed/],
        [() => k.run('pool_stop', null, []), RangeError, /the thread pool's own/],
        [() => k.run('exp_f32', null, [0, 0, 128]), RangeError, /an address in the heap/],
        [() => k.run('exp_f32', null, [new Float32Array(8), new Float32Array(8), 'eight']), TypeError, /expected a 32-bit integer/],
        [() => k.runJob(matvecJob, 256, 16, [held.addr, held.addr, 2 ** 32 - 64, 8]), RangeError, /outside the heap/],
        [async () => { const a = await k.quantizeAct(normals(rand, 64)); a.s[0] += 1; return k.qmatvec(w, a); },
          RangeError, /sums do not match the values/], // edited in place: quantizeAct's own is checked too
        [() => k.silu(new Float32Array(8), { threads: 'no' }), TypeError, /threads: expected true or false/],
        [() => k.silu(new Float32Array(8), { chunk: -3 }), RangeError, /chunk/],
        [() => { k.manifest.activation.max = 1e6; }, TypeError, /read only/],
        [() => k.bench('dotF32', [lying, lying], { minMs: Infinity }), RangeError, /minMs must be a number/],
        [() => k.dotF32(lying, lying), TypeError, /length or byteLength is overridden/],
        [() => k.qmatvec(w, { ...act, s: act.s.map((v) => v + 1000) }), RangeError, /sums do not match the values/],
        [() => k.rope(new Float32Array(32), new Float32Array(0), new Float32Array(0)), RangeError, /cos and sin hold dim/],
        [() => k.matmulF32(new Float32Array(4), new Float32Array(4), 2, 2, 5), TypeError, /options must be an object/],
        [() => k.matmulF32(new Float32Array(16), new Float32Array(16), 4, 4, { bTransposed: 'no' }), TypeError, /expected true or false/],
        [() => k.pack('__proto__', new Uint8Array(18), 1, 32), TypeError, /unknown quant type __proto__/],
        [() => k.runJob('toString', 1, 1, []), TypeError, /no job "toString"/],
        [() => k.ropeTable(4, 8, 10000n), TypeError, /ropeTable: expected numbers, got theta bigint/],
        // raw calls are held to the extents and multiples the kernels' docs declare (manifest params)
        [() => k.run('exp_f32', null, [new Float32Array(8), new Float32Array(8), 64]), RangeError,
          /run: exp_f32 x \(f32\[n\]\): needs 256 bytes, got a typed array of 32/],
        [() => k.run('exp_f32', null, [held.addr, held.addr, 2 ** 29]), RangeError, /x \(f32\[n\]\): 2147483648 bytes from address \d+ run past the memory's end/],
        [() => k.run('act_check', null, [new Int16Array(64), new Float32Array(4), 48]), RangeError, /act_check n: must be a multiple of 32, got 48/],
        [() => k.run('softmax_f32', null, [new Float32Array(8), 2, 24, 4]), RangeError, /softmax_f32 stride: must be at least 24 \(t\), got 4/],
        [() => k.run('exp_f32', null, [held.addr, held.addr, new Int32Array([4])]), TypeError, /exp_f32 n: expected a 32-bit integer, got a typed array/],
        // a sentence longer than attention's scratch row (its length is data: the kernel traps)
        [() => k.run('attention_f32', null, [new Float32Array(40 * 48), new Int32Array([0, 40]), new Float32Array(4), new Float32Array(40 * 16), 1, 1, 16, 4]),
          WebAssembly.RuntimeError, /unreachable/],
        // its rows are data too, read from starts for the extents of qkv and y: one row short is refused
        [() => k.run('attention_f32', null, [new Float32Array(39 * 48), new Int32Array([0, 40]), new Float32Array(40), new Float32Array(40 * 16), 1, 1, 16, 40]),
          RangeError, /attention_f32 qkv \(f32\[starts\[seqs\], 3 \* heads \* d\]\): needs 7680 bytes, got a typed array of 7488/],
        [() => k.run('qmatvec', 'q4_1', [w.planes.q, w.planes.scale, w.planes.offset, held.addr, held.addr, held.addr, 2 ** 20, 64]), RangeError,
          /qmatvec_q4_1\S* w_q \(packed\[n, k\]\): \d+ bytes from address \d+ run past the memory's end/],
      ];
      for (const [call, Type, message] of misuse) await assert.rejects(async () => call(), (e) => e instanceof Type && message.test(e.message), String(call));
      const doomed = await k.pack('q4_1', randomBlocks(k.manifest.quants.q4_1, 2 * 2, rand), 2, 64);
      let freed = false; // an activation getter that frees the weights while the call reads it
      const sly = { get q() { if (!freed) { freed = true; k.free(doomed); } return act.q; }, d: act.d, s: act.s };
      await assert.rejects(async () => k.qmatvec(doomed, sly), /these weights were freed/);
      const { arrays } = await k.run('exp_f32', null, [new Float32Array(8), new Float32Array(8), 8]); // to the last byte
      assert.deepEqual([...arrays[1]], Array(8).fill(1));
      await k.free(held);
      assert.equal(firstDifference(await k.qmatvec(w, act), want), null);
      assert.equal(firstDifference(await k.qmatvec(w, act, { threads: true }), want), null);
      await k.free(w);
    });

    test('2,000 small jobs in a row neither deadlock nor differ', async () => {
      const x = normals(random(11), 64);
      const want = await k.silu(x);
      for (let i = 0; i < 2000; i++) {
        const got = await k.silu(x, { threads: true, chunk: 1 });
        if (firstDifference(got, want)) assert.fail(`job ${i} differs`);
      }
    });

    test('a trap in a job raises JobError in the caller, and the pool recovers', async () => {
      const job = Object.keys(k.manifest.jobs).find((name) => k.manifest.jobs[name].kernel === 'matvec_f32_job');
      // rows of 2^29 values from a held array: every row's loads run past the memory and trap
      const held = await k.hold(new Float32Array(64));
      await assert.rejects(k.runJob(job, 64, 1, [held.addr, held.addr, held.addr, 2 ** 29]), (e) => {
        assert.ok(e instanceof JobError, e.message);
        assert.ok(e.driverError && e.helperErrors.length === THREADS - 1, `${e.message}: helpers ${e.helperErrors}`);
        return true;
      });
      const wf = normals(random(3), 40 * 64);
      const xf = normals(random(4), 64);
      assert.equal(firstDifference(await k.matvecF32(wf, xf, { threads: true, chunk: 1 }), await k.matvecF32(wf, xf)), null);
    });

    test('wrong arguments are refused before any memory is touched', async () => {
      const x = new Float32Array(64);
      await assert.rejects(k.quantizeAct(new Float64Array(64)), TypeError);
      await assert.rejects(k.quantizeAct(new Float32Array(33)), RangeError);
      await assert.rejects(k.pack('q8_0', new Uint8Array(33), 1, 32), RangeError);
      await assert.rejects(k.pack('nope', new Uint8Array(34), 1, 32), /unknown quant type nope/);
      const onnx = k.manifest.quants.q4_onnx;
      if (onnx) { // a zero point of 255 unpacks to 0 - 255: not a weight the int8 kernels can hold
        const block = randomBlocks(onnx, 1, random(9));
        block[onnx.fields.find((f) => f.name === 'z').offset] = 255;
        await assert.rejects(k.pack('q4_onnx', block, 1, 32), /pack\(q4_onnx\): block 0 unpacks to -2\d\d at element \d+, outside int8/);
        // values 15 - 130 fit int8, but a zero point past 127 does not fit the relaxed dot's 7-bit operand
        const qs = onnx.fields.find((f) => f.name === 'qs');
        block.fill(0xff, qs.offset, qs.offset + qs.count);
        block[onnx.fields.find((f) => f.name === 'z').offset] = 130;
        await assert.rejects(k.pack('q4_onnx', block, 1, 32), /pack\(q4_onnx\): block 0 has z = 130, outside 0\.\.127/);
      }
      await assert.rejects(k.qmatvec({ quant: 'q8_0' }, await k.quantizeAct(x)), TypeError);
      const w = await k.pack('q8_0', new Uint8Array(2 * 34), 1, 64);
      await assert.rejects(k.qmatvec(w, await k.quantizeAct(new Float32Array(32))), RangeError);
      await assert.rejects(k.qmatvec(w, { q: new Float32Array(64), d: new Float32Array(2) }), TypeError);
      const two = await k.quantizeAct(new Float32Array(128), 2);
      await assert.rejects(k.qmatvec(w, two), RangeError); // two tokens: qmatmul's
      await assert.rejects(k.qmatmul(w, await k.quantizeAct(new Float32Array(96), 3)), /not whole rows/);
      await assert.rejects(k.quantizeAct(new Float32Array(96), 2), RangeError); // rows of 48
      await assert.rejects(k.matmulF32(new Float32Array(12), new Float32Array(10), 3, 2), /n \* k = 2 \* 4/);
      await assert.rejects(k.matmulF32(new Float32Array(12), new Float64Array(8), 3, 2), TypeError);
      await assert.rejects(k.softmax(x, 5, 6), RangeError);
      await assert.rejects(k.rope(x, new Float32Array(3), new Float32Array(3)), RangeError);
      await assert.rejects(k.gelu(new Float32Array(12), new Float32Array(6)), RangeError); // rows not a multiple of 4
      await assert.rejects(k.gelu(new Float64Array(8), null), TypeError);
      await assert.rejects(k.layerNorm(new Float32Array(8), new Float32Array(4), new Float32Array(3), null, null, 1e-5),
        /expected 4 values/);
      await assert.rejects(k.layerNorm(new Float32Array(8), new Float32Array(4), new Float32Array(4), null, null, -1), RangeError);
      await assert.rejects(k.meanPool(new Float32Array(24), new Float32Array(6), 4), RangeError);
      await assert.rejects(k.l2Normalize(new Float32Array(10), 5), RangeError);
      await assert.rejects(k.setThreads(THREADS + 1), RangeError);
      await assert.rejects(k.runJob('no_such_job', 1, 1, []), /no job/);
    });

    test('a held array stays until free(); it is refused once freed, after reset() and by other kernels', async () => {
      const rand = random(13);
      const x = normals(rand, 6 * 32);
      const h = await k.hold(x);
      assert.equal(h.length, x.length);
      assert.equal(firstDifference(await k.read(h), x), null);
      const w = await k.pack('q8_0', randomBlocks(k.manifest.quants.q8_0, 8, rand), 8, 32);
      const bias = normals(rand, 8);
      const y = await k.linear(w, h, bias, { hold: true, threads: true });
      assert.equal(firstDifference(await k.read(y), await k.addBias(await k.qmatmul(w, await k.quantizeAct(x, 6)), bias)), null);
      const g = await k.gelu(y, null, { hold: true }); // a held input is read, not written over
      assert.equal(firstDifference(await k.read(g), await k.gelu(await k.read(y), null)), null);
      await k.free(h);
      await k.free(h); // again: nothing happens
      await assert.rejects(k.read(h), /freed/);
      await assert.rejects(k.linear(w, h, null), /freed/);
      await assert.rejects(k.read(x), TypeError);
      await assert.rejects(k.gelu({ held: true, length: 4 }, null), /must come from hold/);
      await assert.rejects(k.linear(w, await k.hold(new Float32Array(33)), null), RangeError);
      await assert.rejects(k.linear(w, x, new Float32Array(7)), /expected 8 values/);
      const other = await loadKernels({ target, threads: 1 });
      try {
        await assert.rejects(other.read(g), /held by other kernels/);
        await assert.rejects(other.free(g), /held by other kernels/);
        const mine = await other.hold(x);
        await other.reset();
        await assert.rejects(other.read(mine), /before reset/);
      } finally {
        await other.terminate();
      }
      await k.free(y);
      await k.free(g);
      await k.free(w);
    });

    test('copies in and out stay right when the memory grows between calls (the driver keeps its views of it)', async () => {
      const other = await loadKernels({ target, threads: 1 });
      try {
        const rand = random(17);
        const spec = other.manifest.quants.q8_0;
        const x = normals(rand, 256);
        const h = await other.hold(x);
        const act = await other.quantizeAct(x);
        const w = await other.pack('q8_0', randomBlocks(spec, 5 * 8, rand), 5, 256);
        const y = await other.qmatvec(w, act);
        const big = 8 << 20; // more than the memory holds so far: pack grows it
        const wBig = await other.pack('q8_0', randomBlocks(spec, big / 32, rand), big / 256, 256);
        assert.equal(firstDifference(await other.read(h), x), null);
        const again = await other.quantizeAct(x);
        for (const part of ['q', 'd', 's']) assert.equal(firstDifference(again[part], act[part]), null, part);
        assert.equal(firstDifference(await other.qmatvec(w, act), y), null);
        const yBig = await other.qmatvec(wBig, act);
        assert.equal(yBig.length, big / 256);
        assert.ok(yBig.every(Number.isFinite) && yBig.some((v) => v !== 0));
      } finally {
        await other.terminate();
      }
    });

    test('another thread setting the stop flag ends a bench loop', async () => {
      const setter = new Worker('const { workerData } = require("node:worker_threads");'
        + 'setTimeout(() => Atomics.store(workerData, 0, 1), 100);', { eval: true, workerData: k.stopFlag });
      const x = normals(random(5), 4096);
      const start = performance.now();
      const r = await k.bench('silu', [x, { threads: true }], { minMs: 20_000, maxIterations: 1e9 });
      await setter.terminate();
      assert.ok(r.stopped && performance.now() - start < 10_000, JSON.stringify(r));
    });
  });
}

test('terminate stops the pool and frees the memory; a new pool can start', async () => {
  for (let round = 0; round < 2; round++) {
    const k = await loadKernels({ target: 'simd128', threads: THREADS });
    assert.equal(k.info.threads, THREADS);
    await k.terminate();
    await assert.rejects(k.silu(new Float32Array(4)), /terminated/);
  }
});

describe('test vectors from wasmtime (tests/test_js.py)', { skip: VECTORS ? false : 'KERNELGEN_VECTORS is not set' }, () => {
  const read = async (file) => {
    const b = await readFile(join(VECTORS, file));
    return b.buffer.slice(b.byteOffset, b.byteOffset + b.byteLength);
  };
  // each target's base build, and each flavor of it (same expected bits), whatever this engine's probe says
  for (const [target, unusable] of TARGETS) {
    for (const flavor of ['base', ...(unusable ? [] : FLAVORS[target])]) {
      test(`${target}${flavor === 'base' ? '' : ` (${flavor} flavor)`}`, { skip: unusable ?? false }, async (t) => {
        const index = JSON.parse(await readFile(join(VECTORS, 'index.json'), 'utf8'));
        const k = await loadKernels({ target, flavor, threads: index.threads });
        try {
          assert.equal(k.info.flavor, flavor === 'base' ? null : flavor);
          const results = await runVectors(k, index, read);
          assert.ok(results.length > 0);
          for (const r of results) await t.test(r.name, () => assert.ok(r.ok, r.detail));
        } finally {
          await k.terminate();
        }
      });
    }
  }
});
