// `kernelgen bench --engine chromium`: the mat-vec and GEMM rows (bench_rows.mjs) in a page of
// headless Chromium (chromium_page.mjs), the browser's own V8: newer than Node's, and it lowers
// relaxed SIMD with the CPU's dot-product instructions where it has them. Started by
// kernelgen/tuning/bench.py as
//   node chromium_bench.mjs CONFIG_JSON
// with bench_rows.mjs's config in file: URLs (`out` a directory holding `seed` too) plus `chromium`,
// the browser's executable. Serves `out`, the runtime's directory and this one, runs benchRows in
// the page with the config's URLs pointed there, and prints one JSON object: {engine, target, rows}.

import { basename, dirname } from 'node:path';
import { fileURLToPath } from 'node:url';

import { withChromiumPage } from './chromium_page.mjs';

const config = JSON.parse(process.argv[2]);
const outDir = fileURLToPath(config.out);
const runtimeDir = dirname(fileURLToPath(config.runtime));
if (dirname(fileURLToPath(config.seed)) !== outDir.replace(/\/$/, '')) throw new Error('seed must lie in out');
const mounts = { '/tuning/': dirname(fileURLToPath(import.meta.url)), '/runtime/': runtimeDir };
await withChromiumPage({ chromium: config.chromium, runtimeDir, mounts, pageDir: outDir, pagePrefix: '/bench/' },
  async (page, url, engine) => {
    const pageConfig = {
      ...config, out: `${url}bench/`, seed: `${url}bench/${basename(fileURLToPath(config.seed))}`,
      runtime: `${url}runtime/${basename(fileURLToPath(config.runtime))}`,
    };
    const result = await page.evaluate(async (c) => (await import('/tuning/bench_rows.mjs')).benchRows(c), pageConfig);
    console.log(JSON.stringify({ engine, ...result }));
  });
