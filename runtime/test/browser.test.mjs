// The runtime in a real browser: Debian's Chromium (never a downloaded one) driven by
// playwright-core loads the demo page from runtime/serve.mjs, which must come out cross-origin
// isolated with a pool of workers and its benchmark table; with KERNELGEN_VECTORS set
// (tests/test_js.py), the page runs the wasmtime vectors on both targets and the demo loads the
// vectors' model.gguf as a user's pick. The screenshot goes to
// KERNELGEN_SCREENSHOT (default: kernelgen-demo.png in the temp dir).

import assert from 'node:assert/strict';
import { existsSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { after, before, describe, test } from 'node:test';

import { CHROMIUM, LAUNCH_ARGS } from '../chromium.mjs';
import { startServer } from '../serve.mjs';

const VECTORS = process.env.KERNELGEN_VECTORS;
const SCREENSHOT = process.env.KERNELGEN_SCREENSHOT ?? join(tmpdir(), 'kernelgen-demo.png');
const THREADS = 2;
const PAGE_TIMEOUT_MS = 60_000;
const SUITE_TIMEOUT_MS = 150_000; // a deadlocked pool fails the suite instead of hanging it

const playwright = await import('playwright-core').catch(() => null);
const missing = !existsSync(CHROMIUM) ? `${CHROMIUM} is missing (apt-get install chromium)`
  : !playwright ? 'playwright-core is not installed (npm ci)' : false;

/** Open the demo and wait until its first benchmark run has finished; -> [page, window.kernelgenDemo]. */
async function openDemo(browser, url) {
  const page = await browser.newPage({ viewport: { width: 1280, height: 900 } });
  const errors = [];
  page.on('pageerror', (e) => errors.push(e.message));
  await page.goto(url);
  await page.waitForSelector('body[data-state=done], body[data-state=failed]', { timeout: PAGE_TIMEOUT_MS });
  const state = await page.evaluate(() => window.kernelgenDemo);
  assert.equal(state.error, null, `the demo failed: ${state.error}`);
  assert.deepEqual(errors, []);
  return [page, state];
}

describe('Chromium', { skip: missing, timeout: SUITE_TIMEOUT_MS }, () => {
  let server;
  let browser;
  let page;
  let demo;

  before(async () => {
    server = await startServer({ mounts: VECTORS ? { '/vectors/': VECTORS } : {} });
    browser = await playwright.chromium.launch({ executablePath: CHROMIUM, args: LAUNCH_ARGS });
    [page, demo] = await openDemo(browser, `${server.url}runtime/demo/?threads=${THREADS}`);
  });

  after(async () => {
    await browser?.close();
    await server?.close();
  });

  test('the page is cross-origin isolated and runs a pool of workers', async () => {
    assert.equal(await page.evaluate(() => crossOriginIsolated), true);
    assert.equal(demo.info.crossOriginIsolated, true);
    assert.equal(demo.info.threads, THREADS);
  });

  test('relaxed SIMD is chosen, its dot probed', async (t) => {
    t.diagnostic(`relaxed dot in Chromium: ${JSON.stringify(demo.info.relaxedDot)}`);
    assert.equal(demo.info.relaxedDot.supported, true, 'Chromium has had relaxed SIMD since 114');
    assert.equal(demo.info.target, demo.info.relaxedDot.usable ? 'relaxed-simd' : 'simd128', demo.info.targetReason);
    // a flavor (on x86 with AVX-VNNI: vnni) exactly where the manifest's `when` matches the probe
    const manifest = await (await page.request.get(new URL('/out/relaxed-simd/kernels.json', page.url()).href)).json();
    const suits = Object.entries(manifest.flavors ?? {})
      .find(([, f]) => Object.entries(f.when).every(([k, v]) => demo.info.relaxedDot[k] === v));
    t.diagnostic(`flavor: ${demo.info.flavor} (${demo.info.flavorReason})`);
    assert.equal(demo.info.flavor, demo.info.target === 'relaxed-simd' && suits ? suits[0] : null);
  });

  test('the demo shows its benchmark table, threaded results bit-identical to one thread', async (t) => {
    const rows = await page.locator('#bench tbody tr').count();
    assert.equal(rows, demo.results.length);
    assert.ok(rows >= 5, `${rows} rows`);
    for (const r of demo.results) {
      assert.ok(r.oneMs > 0, `${r.name}: ${r.oneMs}`);
      if (r.threadedMs !== null) assert.equal(r.sameBits, true, r.name);
      t.diagnostic(`${r.name} ${r.size}: ${r.oneMs.toFixed(3)} ms, ${THREADS} threads ${r.threadedMs?.toFixed(3) ?? '-'} ms`);
    }
    assert.ok(demo.results.some((r) => r.sameBits === true));
    await page.screenshot({ path: SCREENSHOT, fullPage: true });
    t.diagnostic(`screenshot: ${SCREENSHOT}`);
  });

  test('every kernel equals wasmtime on both targets, threaded and not', { skip: VECTORS ? false : 'KERNELGEN_VECTORS is not set' }, async (t) => {
    const results = await page.evaluate(async () => {
      const { loadKernels } = await import('/runtime/kernelgen.mjs');
      const { runVectors } = await import('/runtime/testing/vectors.mjs');
      const read = async (file) => {
        const res = await fetch(`/vectors/${file}`);
        if (!res.ok) throw new Error(`/vectors/${file}: HTTP ${res.status}`);
        return res.arrayBuffer();
      };
      const index = await (await fetch('/vectors/index.json')).json();
      const all = [];
      for (const target of Object.keys(index.expected)) {
        const k = await loadKernels({ target, threads: index.threads });
        try {
          all.push(...await runVectors(k, index, read));
        } finally {
          await k.terminate();
        }
      }
      return all;
    });
    assert.ok(results.some((r) => r.name.startsWith('relaxed-simd')) && results.some((r) => r.name.startsWith('simd128')));
    for (const r of results) await t.test(r.name, () => assert.ok(r.ok, r.detail));
  });

  test('the demo lists a .gguf file the user picks and times each tensor\'s mat-vec; a file that is not GGUF is refused', {
    skip: VECTORS ? false : 'KERNELGEN_VECTORS is not set',
  }, async () => {
    const pick = async (file) => {
      await page.setInputFiles('#gguf', join(VECTORS, file));
      await page.waitForSelector('body[data-model=done], body[data-model=failed]', { timeout: PAGE_TIMEOUT_MS });
      return page.evaluate(() => window.kernelgenDemo.model);
    };
    const model = await pick('model.gguf');
    assert.equal(model.error, null);
    assert.deepEqual(model.tensors.map((t) => [t.name, t.type]), [['embd.f32', 'F32'], ['norm.f16', 'F16'], ['norm.bf16', 'BF16'],
      ['attn_q.q8_0', 'Q8_0'], ['attn_k.q4_0', 'Q4_0'], ['ffn_up.q4_k', 'Q4_K'], ['ffn_gate.q5_k', 'Q5_K'],
      ['attn_v.iq4_nl', 'IQ4_NL'], ['attn_o.iq4_xs', 'IQ4_XS'], ['ffn_down.mxfp4', 'MXFP4'], ['attn_out.q3_k', 'Q3_K'],
      ['output.q6_k', 'Q6_K'], ['token_embd.q2_k', 'Q2_K']]);
    for (const t of model.tensors) {
      assert.deepEqual(t.shape, [3, 256], t.name);
      assert.ok(['F32', 'F16', 'BF16'].includes(t.type) ? t.ms === null : t.ms > 0, `${t.name}: ${t.ms}`);
    }
    assert.equal(await page.locator('#model tbody tr').count(), model.tensors.length);
    await page.screenshot({ path: SCREENSHOT, fullPage: true }); // the benchmark and the model's table
    const bad = await pick('index.json');
    assert.match(bad.error, /^GgufError: index.json: not a readable GGUF file \(it does not start with "GGUF"\)$/);
  });

  test('errors reach the page as their classes: a trap in Web Worker helpers as JobError', async () => {
    const seen = await page.evaluate(async (threads) => {
      const { loadKernels, JobError } = await import('/runtime/kernelgen.mjs');
      const k = await loadKernels({ threads });
      const caught = async (promise) => promise.then(() => null, (e) => e);
      try {
        const size = await caught(k.quantizeAct(new Float32Array(33)));
        const job = Object.keys(k.manifest.jobs).find((name) => k.manifest.jobs[name].kernel === 'matvec_f32_job');
        const held = await k.hold(new Float32Array(64)); // rows of 2^29 values from it: every row's loads trap
        const trap = await caught(k.runJob(job, 64, 1, [held.addr, held.addr, held.addr, 2 ** 29]));
        const after = await k.silu(new Float32Array([1, 2, 3]), { threads: true });
        return { size: size instanceof RangeError, trap: trap instanceof JobError, driver: Boolean(trap.driverError),
          helpers: trap.helperErrors.length, after: Array.from(after) };
      } finally {
        await k.terminate();
      }
    }, THREADS);
    assert.deepEqual({ ...seen, after: seen.after.length }, { size: true, trap: true, driver: true, helpers: THREADS - 1, after: 3 });
  });

  test('without the isolation headers the page falls back to one thread and says so', async () => {
    const plain = await startServer({ isolate: false });
    try {
      const [p, state] = await openDemo(browser, `${plain.url}runtime/demo/`);
      assert.equal(await p.evaluate(() => crossOriginIsolated), false);
      assert.equal(state.info.threads, 1);
      assert.match(state.info.notes.join(' '), /not cross-origin isolated/);
      await p.close();
    } finally {
      await plain.close();
    }
  });
});
