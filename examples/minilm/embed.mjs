// Embed token ids with the JS model (minilm.mjs) and write the embeddings as raw little-endian f32.
//
//   node --experimental-wasm-relaxed-simd --no-liftoff examples/minilm/embed.mjs \
//        MODEL.safetensors IDS.json OUT.bin [--target relaxed-simd|simd128] [--threads N] [--browser]
//
// MODEL: export.py's file. IDS.json: [[101, ..., 102], ...], one array of token ids per sentence
// (tokenized by the host). With --threads N > 1 the threaded kernels run through an N-thread pool.
// --browser runs the model in headless Chromium (Debian's /usr/bin/chromium, driven by
// playwright-core) on a cross-origin isolated page of runtime/serve.mjs instead of in Node.

import { readFile, writeFile } from 'node:fs/promises';
import { basename, dirname } from 'node:path';
import { parseArgs } from 'node:util';

import { loadKernels } from '../../runtime/kernelgen.mjs';
import { withPage } from './chromium.mjs';
import { embedOnce } from './minilm.mjs';

/** The same in Chromium: the page imports the runtime and minilm.mjs from the server. */
async function embedInChromium(modelPath, ids, target, threads) {
  const result = await withPage({ mounts: { '/model/': dirname(modelPath) } }, (page) => page.evaluate(async ({ file, ids, target, threads }) => {
    const { loadKernels } = await import('/runtime/kernelgen.mjs');
    const { embedOnce } = await import('/minilm/minilm.mjs');
    const bytes = new Uint8Array(await (await fetch(`/model/${file}`)).arrayBuffer());
    return Array.from(await embedOnce(loadKernels, bytes, ids, { target, threads }));
  }, { file: encodeURIComponent(basename(modelPath)), ids, target, threads }));
  return Float32Array.from(result);
}

const { values, positionals } = parseArgs({
  allowPositionals: true,
  options: { target: { type: 'string' }, threads: { type: 'string', default: '1' }, browser: { type: 'boolean', default: false } },
});
if (positionals.length !== 3) {
  console.error('usage: embed.mjs MODEL.safetensors IDS.json OUT.bin [--target T] [--threads N] [--browser]');
  process.exit(2);
}
const [modelPath, idsPath, outPath] = positionals;
const threads = Number(values.threads);
if (!Number.isInteger(threads) || threads < 1) {
  console.error(`embed.mjs: --threads must be a positive integer, got ${values.threads}`);
  process.exit(2);
}
const ids = JSON.parse(await readFile(idsPath, 'utf8'));
const e = values.browser
  ? await embedInChromium(modelPath, ids, values.target, threads)
  : await embedOnce(loadKernels, new Uint8Array(await readFile(modelPath)), ids, { target: values.target, threads });
await writeFile(outPath, new Uint8Array(e.buffer, e.byteOffset, e.byteLength));
