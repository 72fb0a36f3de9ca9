// GGUF files through runtime/gguf.mjs, against what llama.cpp's own Python reader (the gguf package)
// and wasmtime made of the same files: tests/test_js_gguf.py writes them and sets KERNELGEN_GGUF.
// Run: node --experimental-wasm-relaxed-simd --no-liftoff --test runtime/test/gguf.test.mjs

import assert from 'node:assert/strict';
import { existsSync } from 'node:fs';
import { readFile } from 'node:fs/promises';
import { join } from 'node:path';
import { pathToFileURL } from 'node:url';
import { after, before, describe, test } from 'node:test';

import { CHROMIUM, withPage } from '../chromium.mjs';
import { GGML_TYPES, GgufError, loadGguf, loadKernels, probeRelaxedDot, readGgufInfo } from '../kernelgen.mjs';
import { startServer } from '../serve.mjs';
import { firstDifference } from '../testing/vectors.mjs';

const DIR = process.env.KERNELGEN_GGUF;
const OUT = new URL('../../out/', import.meta.url);
const probe = await probeRelaxedDot();
const TARGETS = ['simd128', ...(probe.usable ? ['relaxed-simd'] : [])];

const playwright = await import('playwright-core').catch(() => null);
const bytesOf = async (file) => new Uint8Array(await readFile(join(DIR, file)));
const floatsOf = async (file) => new Float32Array((await bytesOf(file)).buffer);

/** A JS value of the reader's as test_js_gguf.py's field_json writes the gguf package's: 64-bit
 * integers as decimal strings, NaN as "NaN", arrays (of arrays, flattened) as plain arrays. */
function plain(v) {
  if (typeof v === 'bigint') return String(v);
  if (typeof v === 'number' && Number.isNaN(v)) return 'NaN';
  if (ArrayBuffer.isView(v) || Array.isArray(v)) return [...v].flatMap((e) => (Array.isArray(e) || ArrayBuffer.isView(e) ? plain(e) : [plain(e)]));
  return v;
}

/** Little-endian GGUF bytes from parts, for headers the gguf package will not write. kv: [key, type,
 * value] (type 9: value {elem, items}); tensors: {name, dims, type, offset}; then `data` at the
 * alignment. Numbers in `raw` override the counts and version. */
function ggufBytes({ kv = [], tensors = [], data = new Uint8Array(0), version = 3, alignment = 32, counts = {} }) {
  const parts = [];
  const u = (bits, v) => {
    const b = new DataView(new ArrayBuffer(bits / 8));
    ({ 8: () => b.setUint8(0, v), 16: () => b.setUint16(0, v, true), 32: () => b.setUint32(0, v, true), 64: () => b.setBigUint64(0, BigInt(v), true) })[bits]();
    parts.push(new Uint8Array(b.buffer));
  };
  const str = (s) => { const e = new TextEncoder().encode(s); u(64, e.length); parts.push(e); };
  const value = (type, v) => {
    if (type === 8) str(v);
    else if (type === 9) { u(32, v.elem); u(64, v.count ?? v.items.length); for (const e of v.items) value(v.elem, e); }
    else if (type === 6) { const b = new DataView(new ArrayBuffer(4)); b.setFloat32(0, v, true); parts.push(new Uint8Array(b.buffer)); }
    else u({ 4: 32, 10: 64 }[type] ?? 8, v); // u8, bool and undefined types: a byte
  };
  parts.push(new TextEncoder().encode('GGUF'));
  u(32, version);
  u(64, counts.tensors ?? tensors.length);
  u(64, counts.kv ?? kv.length);
  for (const [key, type, v] of kv) { str(key); u(32, type); value(type, v); }
  for (const t of tensors) { str(t.name); u(32, t.dims.length); for (const d of t.dims) u(64, d); u(32, t.type); u(64, t.offset); }
  let size = parts.reduce((s, p) => s + p.length, 0);
  parts.push(new Uint8Array(Math.ceil(size / alignment) * alignment - size), data);
  const out = new Uint8Array(parts.reduce((s, p) => s + p.length, 0));
  size = 0;
  for (const p of parts) { out.set(p, size); size += p.length; }
  return out;
}

/** An array `depth` arrays deep around an empty u8 array: {elem, items} for ggufBytes. */
const nest = (depth) => (depth === 0 ? { elem: 0, items: [] } : { elem: 9, items: [nest(depth - 1)] });

/** Q8_0 stored blocks of `rows` rows of 32 values, scale 1. */
function q8Blocks(rows) {
  const b = new Uint8Array(rows * 34);
  for (let r = 0; r < rows; r++) { b[r * 34 + 1] = 0x3c; for (let i = 0; i < 32; i++) b[r * 34 + 2 + i] = (r * 5 + i) & 0x7f; }
  return b;
}

describe('GGUF files', { skip: !DIR && 'KERNELGEN_GGUF is not set (tests/test_js_gguf.py sets it)' }, () => {
  let index;
  let server;
  let serverWithoutRanges;
  before(async () => {
    index = JSON.parse(await readFile(join(DIR, 'index.json'), 'utf8'));
    server = await startServer({ mounts: { '/gguf/': DIR } });
    serverWithoutRanges = await startServer({ mounts: { '/gguf/': DIR }, ranges: false });
  });
  after(async () => {
    await server?.close();
    await serverWithoutRanges?.close();
  });

  test('GGML type ids are the gguf package\'s', () => {
    assert.deepEqual({ ...GGML_TYPES }, index.types);
  });

  test('the header reads as gguf.GGUFReader reads it: metadata of every type, tensors, data offsets, a custom alignment', async () => {
    for (const [file, want] of Object.entries(index.files)) {
      if (!want.tensors) continue;
      const info = await readGgufInfo(join(DIR, file));
      assert.equal(info.version, 3);
      assert.equal(info.alignment, file === 'aligned.gguf' ? 256 : 32);
      assert.deepEqual(info.tensors, want.tensors, file);
      assert.deepEqual([...info.metadata.keys()], Object.keys(want.metadata), file);
      for (const [key, { types, value }] of Object.entries(want.metadata)) {
        const got = info.metadata.get(key);
        assert.deepEqual(plain(got), value, `${file} ${key}`);
        const kind = { UINT64: 'bigint', INT64: 'bigint', STRING: 'string', BOOL: 'boolean' }[types[0]] ?? (types[0] === 'ARRAY' ? 'object' : 'number');
        assert.equal(typeof got, kind, `${file} ${key}: ${types}`);
      }
    }
    const scores = (await readGgufInfo(join(DIR, 'model.gguf'))).metadata.get('test.scores');
    assert.ok(scores instanceof Float32Array, 'an array of f32 comes back as a Float32Array');
  });

  for (const target of TARGETS) {
    test(`${target}: every tensor loads from a path, a file URL, bytes, a Blob and HTTP (ranges or not) as wasmtime reads it`, async () => {
      const k = await loadKernels({ dir: OUT.pathname, target, threads: 1 });
      try {
        const x = await floatsOf(index.x); // a tensor of rows of n values takes x[:n]
        const acts = new Map();
        const actFor = async (n) => acts.get(n) ?? acts.set(n, await k.quantizeAct(x.subarray(0, n))).get(n);
        for (const file of ['model.gguf', 'aligned.gguf', 'large.gguf']) {
          const path = join(DIR, file);
          const bytes = await bytesOf(file);
          const sources = {
            path, 'file URL': pathToFileURL(path), bytes, ArrayBuffer: bytes.slice().buffer, Blob: new Blob([bytes]),
            'HTTP ranges': `${server.url}gguf/${file}`, 'HTTP whole': new URL(`${serverWithoutRanges.url}gguf/${file}`),
          };
          const want = index.files[file];
          for (const [kind, source] of Object.entries(sources)) {
            const fetched = []; // the requests' Range headers
            const fetch = globalThis.fetch;
            globalThis.fetch = (url, init) => { fetched.push(init?.headers?.Range); return fetch(url, init); };
            let loaded;
            const progress = [];
            try {
              loaded = await loadGguf(k, source, { onProgress: (p) => progress.push(p) });
            } finally {
              globalThis.fetch = fetch;
            }
            const { version, metadata, tensors } = loaded;
            if (kind !== 'HTTP ranges') assert.deepEqual(fetched, kind === 'HTTP whole' ? ['bytes=0-1048575'] : [], kind);
            else if (file !== 'large.gguf') assert.deepEqual(fetched, ['bytes=0-1048575'], kind); // the header and every tensor
            else { // the first MiB, the rest of the header, then the tensors past what it read
              const asked = fetched.map((r) => r.match(/^bytes=(\d+)-(\d+)$/)).reduce((n, m) => n + Number(m[2]) - Number(m[1]) + 1, 0);
              assert.ok(fetched.length >= 3 && asked < 2 * bytes.length, fetched.join());
            }
            assert.equal(version, 3);
            assert.deepEqual(progress.map((p) => [p.tensor, p.done, p.tensors]), want.tensors.map((t, i) => [t.name, i + 1, want.tensors.length]));
            assert.ok(progress.every((p, i) => p.totalBytes === progress.at(-1).bytes && p.bytes > (progress[i - 1]?.bytes ?? 0)));
            assert.equal(metadata.size, Object.keys(want.metadata).length);
            assert.deepEqual([...tensors.keys()], want.tensors.map((t) => t.name), `${file} ${kind}`);
            for (const t of want.tensors) {
              const got = tensors.get(t.name);
              const expected = await floatsOf(want.expected[target][t.name]);
              if (['F32', 'F16', 'BF16'].includes(t.type)) {
                assert.deepEqual([got.type, got.shape], [t.type, [...t.dims].reverse()]);
                assert.equal(firstDifference(got.data, expected), null, `${file} ${kind} ${t.name}`);
              } else {
                assert.deepEqual([got.quant, got.k, got.rows], [t.type.toLowerCase(), t.dims[0], t.dims[1]]);
                assert.equal(firstDifference(await k.qmatvec(got, await actFor(got.k)), expected), null, `${file} ${kind} ${t.name} qmatvec`);
                await k.free(got);
              }
            }
          }
        }
      } finally {
        await k.terminate();
      }
    });
  }

  test('Chromium: a page loads a .gguf by range requests and from a Blob, its mat-vecs as wasmtime\'s', {
    skip: (!playwright || !existsSync(CHROMIUM)) && 'no Chromium or playwright-core (npm ci)',
  }, async () => {
    const x = [...(await floatsOf(index.x)).subarray(0, 512)]; // model.gguf's rows
    const { target, loaded } = await withPage({ playwright, mounts: { '/gguf/': DIR }, path: 'out/simd128/kernels.wat' }, (page) => page.evaluate(async (x) => {
      const m = await import('/runtime/kernelgen.mjs');
      const k = await m.loadKernels({ threads: 1 });
      const act = await k.quantizeAct(Float32Array.from(x));
      const blob = await (await fetch('/gguf/model.gguf')).blob();
      const loaded = {};
      for (const [kind, source] of [['HTTP ranges', '/gguf/model.gguf'], ['Blob', blob]]) {
        const { tensors } = await m.loadGguf(k, source);
        loaded[kind] = {};
        for (const [name, t] of tensors) loaded[kind][name] = [...(t.quant ? await k.qmatvec(t, act) : t.data)];
      }
      const { target } = k.info;
      await k.terminate();
      return { target, loaded };
    }, x));
    const want = index.files['model.gguf'];
    for (const [kind, tensors] of Object.entries(loaded)) {
      assert.deepEqual(Object.keys(tensors), want.tensors.map((t) => t.name));
      for (const [name, values] of Object.entries(tensors)) {
        assert.equal(firstDifference(Float32Array.from(values), await floatsOf(want.expected[target][name])), null, `${kind} ${name}`);
      }
    }
  });

  describe('refusals, with nothing left packed', () => {
    let k;
    let probeAt; // where a one-row pack lands: a leak moves it
    const landing = async () => {
      const w = await k.pack('q8_0', q8Blocks(1), 1, 32);
      await k.free(w);
      return w.planes.q;
    };
    before(async () => {
      k = await loadKernels({ dir: OUT.pathname, target: 'simd128', threads: 1 });
      probeAt = await landing();
    });
    after(async () => { await k?.terminate(); });

    test('a tensor of a type the build does not support names it, its type and the supported types', async () => {
      const path = join(DIR, 'iq2_xxs.gguf');
      await assert.rejects(loadGguf(k, path), {
        name: 'GgufError',
        message: `${path}: tensor "output.iq2_xxs" has type IQ2_XXS, which this build does not support (supported: ${index.files['iq2_xxs.gguf'].supported})`,
      });
      const unknown = ggufBytes({ tensors: [{ name: 'w', dims: [32, 1], type: 99, offset: 0 }], data: new Uint8Array(64) });
      await assert.rejects(loadGguf(k, unknown), /tensor "w" has type unknown\(99\), which this build does not support/);
      assert.equal(await landing(), probeAt);
    });

    test('a cut or damaged file is a GgufError or loads; never another error, a hang or a leak', async () => {
      const file = await bytesOf('model.gguf');
      const dataStart = index.files['model.gguf'].tensors[0].offset;
      const outcomes = { GgufError: 0, loaded: 0 };
      const attempt = async (bytes, what) => {
        try {
          const { tensors } = await loadGguf(k, bytes);
          for (const t of tensors.values()) if (t.quant) await k.free(t);
          outcomes.loaded++;
        } catch (e) {
          assert.ok(e instanceof GgufError, `${what}: ${e.name}: ${e.message}`);
          outcomes.GgufError++;
        }
      };
      for (let cut = 0; cut < dataStart + 64; cut++) await attempt(file.subarray(0, cut), `cut at ${cut}`);
      await attempt(file.subarray(0, file.length - 1), 'the last byte cut');
      for (let at = 0; at < dataStart; at++) {
        for (const b of [0x00, 0xff]) {
          const damaged = file.slice();
          damaged[at] = b;
          await attempt(damaged, `byte ${at} set to ${b}`);
        }
      }
      assert.ok(outcomes.GgufError > dataStart && outcomes.loaded > 0, JSON.stringify(outcomes));
      assert.equal(await landing(), probeAt);
    });

    test('malformed headers are refused, each naming what is wrong', async () => {
      const w = { name: 'w', dims: [32, 1], type: GGML_TYPES.Q8_0, offset: 0 };
      const data = q8Blocks(1);
      const cases = [
        [{ version: 1 }, /version 1; versions 2 and 3 are read/],
        [{ version: 0x03000000 }, /a big-endian file/],
        [{ counts: { tensors: 2n ** 64n - 1n } }, /the tensor count is 18446744073709551615, more than the \d+ the rest of the file could hold/],
        [{ counts: { kv: 2n ** 40n } }, /the metadata count is 1099511627776, more than/],
        [{ kv: [['a', 8, 'x'], ['a', 8, 'y']] }, /metadata key "a" appears twice/],
        [{ kv: [['a', 13, 0]] }, /metadata a has value type 13, which GGUF does not define/],
        [{ kv: [['a', 9, { elem: 0, items: [], count: 2n ** 62n }]] }, /metadata a's length is 4611686018427387904, more than/],
        [{ kv: [['a', 9, nest(8)]] }, /metadata a\[0\]\[0\]\[0\]\[0\]\[0\]\[0\]\[0\]\[0\] nests arrays more than 8 deep/],
        [{ kv: [['general.alignment', 4, 24]], alignment: 24 }, /general.alignment is 24, not a power of two/],
        [{ kv: [['general.alignment', 10, 32]] }, /general.alignment has value type u64, not u32/], // llama.cpp takes only a u32
        [{ tensors: [w, w], data }, /tensor "w" appears twice/],
        [{ tensors: [{ ...w, dims: [32, 1, 1, 1, 1] }], data }, /tensor w has 5 dimensions, not 1 to 4/],
        [{ tensors: [{ ...w, dims: [32, 0] }], data }, /tensor w has dimensions \[32, 0\]/],
        [{ tensors: [{ ...w, offset: 8 }], data }, /tensor w's data offset 8 is not a multiple of the alignment 32/],
        [{ tensors: [{ ...w, dims: [16, 1] }], data }, /tensor "w" \(Q8_0\) has rows of 16 values, not whole blocks of 32/],
        [{ tensors: [{ ...w, dims: [32, 2] }], data }, /tensor "w"'s 68 bytes at \d+ lie past the end of the file/],
        [{ tensors: [w, { ...w, name: 'v', offset: 32 }], data: new Uint8Array(96) }, /tensors "w" and "v" overlap/],
      ];
      for (const [parts, message] of cases) await assert.rejects(loadGguf(k, ggufBytes(parts)), { name: 'GgufError', message }, String(message));
      const bad = ggufBytes({ kv: [['\u00ff', 8, 'x']] });
      bad.set([0xc3, 0x28], 24 + 8); // the key's two bytes: not UTF-8
      await assert.rejects(loadGguf(k, bad), /metadata key 0 is not UTF-8/);
      const empty = await loadGguf(k, ggufBytes({ kv: [['s', 8, ''], ['a', 9, { elem: 8, items: [] }], ['b', 7, 1], ['n', 9, nest(7)]] }));
      assert.deepEqual([...empty.metadata].slice(0, 3), [['s', ''], ['a', []], ['b', true]]);
      assert.deepEqual(plain(empty.metadata.get('n')), []); // eight arrays deep, the innermost empty
      assert.equal(empty.tensors.size, 0);
      assert.equal(await landing(), probeAt);
    });

    test('a pack that fails part way frees what was packed', async () => {
      const freed = [];
      let calls = 0;
      const failing = {
        manifest: k.manifest,
        pack: (...a) => (++calls === 3 ? Promise.reject(new RangeError('pack failed')) : k.pack(...a)),
        free: (w) => { freed.push(w.quant); return k.free(w); },
      };
      await assert.rejects(loadGguf(failing, join(DIR, 'model.gguf')), { name: 'RangeError', message: 'pack failed' });
      assert.deepEqual(freed, ['q8_0', 'q4_0']);
      freed.length = 0; // a progress callback that throws ends the load the same way
      const stop = (p) => { if (p.done === 5) throw new Error('enough'); }; // after three floats, Q8_0 and Q4_0
      await assert.rejects(loadGguf({ ...failing, pack: (...a) => k.pack(...a) }, join(DIR, 'model.gguf'), { onProgress: stop }), /enough/);
      assert.deepEqual(freed, ['q8_0', 'q4_0']);
      // kernels terminated during the load: their packs fail, and so would freeing what was packed;
      // the pack's error comes out, not the free's
      const k2 = await loadKernels({ dir: OUT.pathname, target: 'simd128', threads: 1 });
      calls = 0;
      const ending = {
        manifest: k2.manifest,
        free: (w) => k2.free(w),
        async pack(...a) {
          if (++calls === 2) {
            await k2.terminate();
            throw new RangeError('pack after terminate failed');
          }
          return k2.pack(...a);
        },
      };
      await assert.rejects(loadGguf(ending, join(DIR, 'model.gguf')), { name: 'RangeError', message: 'pack after terminate failed' });
      assert.equal(await landing(), probeAt);
    });

    test('a load that fails part way cancels the download it read ahead', async () => {
      // three Q8_0 tensors of 1.1 MB each, past the first read's megabyte; the server sends the third
      // request's first 64 KB and holds the rest: that is the read ahead while the first tensor is
      // packed, and the pack fails once it is under way
      const rows = 32768;
      const names = ['a', 'b', 'c'];
      const file = ggufBytes({
        tensors: names.map((name, i) => ({ name, dims: [32, rows], type: GGML_TYPES.Q8_0, offset: i * rows * 34 })),
        data: new Uint8Array(3 * rows * 34).map((_, i) => (i % 34 === 1 ? 0x3c : i % 34 === 0 ? 0 : i & 0x7f)),
      });
      const { createServer } = await import('node:http');
      let requests = 0;
      let holding;
      let held;
      const holds = new Promise((resolve) => { holding = resolve; });
      const heldEnds = new Promise((resolve) => { held = resolve; });
      const slow = createServer((req, res) => {
        const [, from, to] = /^bytes=(\d+)-(\d+)$/.exec(req.headers.range).map(Number);
        const end = Math.min(to, file.length - 1);
        res.writeHead(206, { 'Content-Range': `bytes ${from}-${end}/${file.length}`, 'Content-Length': end - from + 1 });
        if (++requests !== 3) return res.end(file.subarray(from, end + 1));
        res.write(file.subarray(from, from + 65536), holding);
        const rest = setTimeout(() => res.end(file.subarray(from + 65536, end + 1)), 30000);
        res.on('close', () => { clearTimeout(rest); held(res.writableFinished ? 'sent whole' : 'cancelled'); });
        return undefined;
      });
      await new Promise((resolve) => slow.listen(0, '127.0.0.1', resolve));
      try {
        const failing = { manifest: k.manifest, free: (w) => k.free(w), pack: () => holds.then(() => { throw new RangeError('pack failed'); }) };
        await assert.rejects(loadGguf(failing, `http://127.0.0.1:${slow.address().port}/m.gguf`), { name: 'RangeError' });
        assert.equal(requests, 3);
        assert.equal(await heldEnds, 'cancelled');
      } finally {
        slow.closeAllConnections();
        await new Promise((resolve) => slow.close(resolve));
      }
      assert.equal(await landing(), probeAt);
    });

    test('an aborted load stops, and misuse is a TypeError', async () => {
      const ctl = new AbortController();
      ctl.abort();
      await assert.rejects(loadGguf(k, `${server.url}gguf/model.gguf`, { signal: ctl.signal }), { name: 'AbortError' });
      await assert.rejects(loadGguf(k, join(DIR, 'model.gguf'), { signal: ctl.signal }), { name: 'AbortError' });
      const path = join(DIR, 'model.gguf');
      for (const [args, message] of [
        [[null, path], /kernels must come from loadKernels/], [[{ manifest: k.manifest }, path], /kernels must come from loadKernels/],
        [[k, 42], /source must be a URL, a path or URL string, a Blob, an ArrayBuffer or a typed array/],
        [[k, null], /source must be/], [[k, path, 'fast'], /options must be an object/], [[k, path, { signal: {} }], /signal must be an AbortSignal/],
        [[k, path, { onProgress: 'log' }], /onProgress must be a function/],
      ]) await assert.rejects(loadGguf(...args), { name: 'TypeError', message });
      await assert.rejects(readGgufInfo(path, 7), { name: 'TypeError', message: /readGgufInfo: options must be an object/ });
      await assert.rejects(loadGguf(k, join(DIR, 'missing.gguf')), { code: 'ENOENT' });
      await assert.rejects(loadGguf(k, `${server.url}gguf/missing.gguf`), /HTTP 404/);
      assert.equal(await landing(), probeAt);
    });
  });
});
