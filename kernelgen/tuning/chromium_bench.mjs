// `kernelgen bench --engine chromium`: the mat-vec and GEMM rows (bench_rows.mjs) in a page of
// headless Chromium, the browser's own V8 (newer than Node's, and it lowers relaxed SIMD with the
// CPU's dot-product instructions where it has them). Started by kernelgen/tuning/bench.py as
//   node chromium_bench.mjs CONFIG_JSON
// with bench_rows.mjs's config in file: URLs (`out` a directory holding `seed` too) plus `chromium`,
// the browser's executable. Serves `out`, the runtime's directory and this one on 127.0.0.1
// (runtime/serve.mjs: a cross-origin isolated origin, so the pool's threads run), runs benchRows in
// a page with the config's URLs pointed there, and prints one JSON object: {engine, target, rows}.
// playwright-core drives the browser: this checkout's node_modules, or the current directory's
// (an installed wheel's copy of this file has none beside it).

import { writeFile } from 'node:fs/promises';
import { createRequire } from 'node:module';
import { basename, dirname, join } from 'node:path';
import { fileURLToPath, pathToFileURL } from 'node:url';

// V8's optimizing tier from the first call, as node_bench.mjs runs Node
const LAUNCH_ARGS = ['--headless', '--no-sandbox', '--disable-gpu', '--disable-background-networking',
  '--disable-component-update', '--disable-sync', '--no-first-run', '--js-flags=--no-liftoff'];
const HERE = dirname(fileURLToPath(import.meta.url));

async function playwrightCore() {
  try {
    return await import('playwright-core');
  } catch {
    const path = createRequire(join(process.cwd(), 'package.json')).resolve('playwright-core');
    return import(pathToFileURL(path).href);
  }
}

const config = JSON.parse(process.argv[2]);
const outDir = fileURLToPath(config.out);
const runtimeDir = dirname(fileURLToPath(config.runtime));
if (dirname(fileURLToPath(config.seed)) !== outDir.replace(/\/$/, '')) throw new Error('seed must lie in out');
await writeFile(join(outDir, 'page.html'), '<!doctype html><meta charset="utf-8"><title>kernelgen bench</title>\n');
const { startServer } = await import(pathToFileURL(join(runtimeDir, 'serve.mjs')).href);
const playwright = await playwrightCore();
const server = await startServer({ mounts: { '/bench/': outDir, '/tuning/': HERE, '/runtime/': runtimeDir } });
try {
  const browser = await playwright.chromium.launch({ executablePath: config.chromium, args: LAUNCH_ARGS });
  try {
    const page = await browser.newPage();
    const errors = [];
    page.on('pageerror', (e) => errors.push(e.message));
    await page.goto(`${server.url}bench/page.html`);
    const pageConfig = {
      ...config, out: `${server.url}bench/`, seed: `${server.url}bench/${basename(fileURLToPath(config.seed))}`,
      runtime: `${server.url}runtime/${basename(fileURLToPath(config.runtime))}`,
    };
    const result = await page.evaluate(async (c) => {
      if (!globalThis.crossOriginIsolated) throw new Error('the bench page is not cross-origin isolated');
      return (await import('/tuning/bench_rows.mjs')).benchRows(c);
    }, pageConfig);
    if (errors.length) throw new Error(`the bench page failed: ${errors.join('; ')}`);
    console.log(JSON.stringify({ engine: `chromium ${browser.version()}`, ...result }));
  } finally {
    await browser.close();
  }
} finally {
  await server.close();
}
