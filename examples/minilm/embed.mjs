// Embed token ids with the JS model (minilm.mjs) and write the embeddings as raw little-endian f32.
//
//   node --experimental-wasm-relaxed-simd --no-liftoff examples/minilm/embed.mjs \
//        MODEL.safetensors IDS.json OUT.bin [--target relaxed-simd|simd128] [--threads N]
//
// MODEL: export.py's file. IDS.json: [[101, ..., 102], ...], one array of token ids per sentence
// (tokenized by the host). With --threads N > 1 the threaded kernels run through an N-thread pool.

import { readFile, writeFile } from 'node:fs/promises';
import { parseArgs } from 'node:util';

import { loadKernels } from '../../runtime/kernelgen.mjs';
import { MiniLM } from './minilm.mjs';

const { values, positionals } = parseArgs({
  allowPositionals: true,
  options: { target: { type: 'string' }, threads: { type: 'string', default: '1' } },
});
if (positionals.length !== 3) {
  console.error('usage: embed.mjs MODEL.safetensors IDS.json OUT.bin [--target T] [--threads N]');
  process.exit(2);
}
const [modelPath, idsPath, outPath] = positionals;
const threads = Number(values.threads);
if (!Number.isInteger(threads) || threads < 1) {
  console.error(`embed.mjs: --threads must be a positive integer, got ${values.threads}`);
  process.exit(2);
}
const k = await loadKernels({ target: values.target, threads });
try {
  const model = await MiniLM.load(k, new Uint8Array(await readFile(modelPath)));
  const e = await model.embed(JSON.parse(await readFile(idsPath, 'utf8')), { threads: threads > 1 });
  await writeFile(outPath, new Uint8Array(e.buffer, e.byteOffset, e.byteLength));
} finally {
  await k.terminate();
}
