// Drive the demo page in headless Chromium (Debian's /usr/bin/chromium, playwright-core): serve it,
// wait until the corpus is embedded, type each query, and print what the page found as JSON
// {info, sentences, corpusMs, results: [{query, ms, top: [{index, score}]}]}; keep a screenshot.
//
//   node examples/minilm/demo/drive.mjs MODEL_DIR QUERIES.json SCREENSHOT.png [--threads N] [--limit N]
//
// MODEL_DIR holds export.py's minilm-q8_0.safetensors and the model's tokenizer.json (served at /model/).

import { readFile } from 'node:fs/promises';
import { parseArgs } from 'node:util';

import { withPage } from '../chromium.mjs';

const TIMEOUT_MS = 300_000; // a stuck page fails instead of hanging

const { values, positionals } = parseArgs({
  allowPositionals: true, options: { threads: { type: 'string', default: '2' }, limit: { type: 'string' } },
});
if (positionals.length !== 3) {
  console.error('usage: drive.mjs MODEL_DIR QUERIES.json SCREENSHOT.png [--threads N] [--limit N]');
  process.exit(2);
}
const [modelDir, queriesFile, screenshot] = positionals;
const queries = JSON.parse(await readFile(queriesFile, 'utf8'));
const search = new URLSearchParams({ threads: values.threads, ...(values.limit ? { limit: values.limit } : {}) });
const found = await withPage({ mounts: { '/model/': modelDir }, path: `minilm/demo/?${search}`, viewport: { width: 1100, height: 800 } }, async (page) => {
  const settled = 'body[data-state=ready], body[data-state=failed]';
  await page.waitForSelector(settled, { timeout: TIMEOUT_MS });
  for (const [i, query] of queries.entries()) {
    await page.fill('#query', query);
    await page.press('#query', 'Enter');
    await page.waitForFunction((n) => window.minilmDemo.results.length === n || window.minilmDemo.error, i + 1, { timeout: TIMEOUT_MS });
  }
  await page.screenshot({ path: screenshot, fullPage: true });
  const demo = await page.evaluate(() => window.minilmDemo);
  if (demo.error) throw new Error(`the page failed: ${demo.error}`);
  const rows = await page.locator('#results tbody tr').count();
  return { ...demo, rows, progress: await page.evaluate(() => document.getElementById('progress').value) };
});
console.log(JSON.stringify(found));
