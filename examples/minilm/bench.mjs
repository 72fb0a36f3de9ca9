// Time sentence embeddings with one engine in Node or in headless Chromium: kernelgen's JS model
// (minilm.mjs) or the peer, onnxruntime-web's wasm backend on the int8 ONNX model (timing.mjs: the
// same engines and loop in both places). bench.py runs this once per place, engine, target and
// thread count and prints the table; run alone:
//
//   node --experimental-wasm-relaxed-simd --no-liftoff examples/minilm/bench.mjs IDS.json \
//        --engine kernelgen --model MODEL.safetensors [--lib OUT] [--target T] [--threads N] [--batches 1,8,32] [--browser]
//   node examples/minilm/bench.mjs IDS.json --engine ort --onnx model.onnx [--threads N] [--batches 1,8] [--browser]
//
// IDS.json: [[101, ..., 102], ...] token ids per sentence. --lib: the build's directory (`kernelgen build
// --out`; default the repository's out/). --browser runs the engine in a worker of a
// cross-origin isolated page of headless Chromium (bench-worker.mjs; threads need the isolation),
// onnxruntime-web's browser build served from node_modules, V8 with --no-liftoff as in Node (every engine's wasm optimized from the
// start, not when tiering gets to it). Prints one JSON line per batch size (timeEngine's records,
// plus `where`).

import { readFile } from 'node:fs/promises';
import { basename, dirname, resolve } from 'node:path';
import { fileURLToPath } from 'node:url';
import { parseArgs } from 'node:util';

import { loadKernels } from '../../runtime/kernelgen.mjs';
import { withPage } from './chromium.mjs';
import { kernelgenEngine, ortEngine, timeEngine } from './timing.mjs';

const { values, positionals } = parseArgs({
  allowPositionals: true,
  options: {
    engine: { type: 'string' }, model: { type: 'string' }, lib: { type: 'string' }, onnx: { type: 'string' }, target: { type: 'string' },
    threads: { type: 'string', default: '1' }, batches: { type: 'string', default: '1,8,32' },
    repeat: { type: 'string', default: '3' }, browser: { type: 'boolean', default: false },
  },
});
const fail = (message) => {
  console.error(`bench.mjs: ${message}`);
  process.exit(2);
};
const threads = Number(values.threads);
const batches = values.batches.split(',').map(Number);
const repeat = Number(values.repeat);
if (positionals.length !== 1) fail('usage: bench.mjs IDS.json --engine kernelgen|ort ... (see the file\'s head)');
if (!Number.isInteger(threads) || threads < 1) fail(`--threads must be a positive integer, got ${values.threads}`);
if (batches.some((b) => !Number.isInteger(b) || b < 1)) fail(`--batches must be positive integers, got ${values.batches}`);
if (!Number.isInteger(repeat) || repeat < 1) fail(`--repeat must be a positive integer, got ${values.repeat}`);
const files = { kernelgen: values.model, ort: values.onnx };
const flags = { kernelgen: '--model (export.py\'s file)', ort: '--onnx (the int8 model.onnx)' };
if (!(values.engine in files)) fail(`--engine must be one of ${Object.keys(files).join(', ')}, got ${values.engine}`);
if (!files[values.engine]) fail(`--engine ${values.engine} needs ${flags[values.engine]}`);
const sentences = JSON.parse(await readFile(positionals[0], 'utf8'));
const file = files[values.engine];
const spec = { engine: values.engine, target: values.target, threads, batches, repeat };
const lib = values.lib && resolve(values.lib);

/** In Node: the runtime as imported here, onnxruntime-web's Node build. */
async function inNode() {
  const bytes = new Uint8Array(await readFile(file));
  const engine = spec.engine === 'kernelgen'
    ? await kernelgenEngine((o) => loadKernels({ ...o, dir: lib }), bytes, spec)
    : await ortEngine(await import('onnxruntime-web'), bytes, spec);
  try {
    return await timeEngine(engine, sentences, batches, repeat);
  } finally {
    await engine.close();
  }
}

/** In a cross-origin isolated page (threads need it), the engine in a worker of the page
 * (bench-worker.mjs), onnxruntime-web's browser build (it loads its wasm and its worker script from /ort/). */
function inChromium() {
  const ortDist = dirname(fileURLToPath(import.meta.resolve('onnxruntime-web/wasm')));
  return withPage({ mounts: { '/file/': dirname(file), '/ort/': ortDist, ...(lib ? { '/out/': lib } : {}) }, jsFlags: ['--no-liftoff'] }, (page) => page.evaluate(async (message) => {
    if (!self.crossOriginIsolated) throw new Error('the page is not cross-origin isolated: no threads');
    const worker = new Worker('/minilm/bench-worker.mjs', { type: 'module' });
    try {
      const reply = await new Promise((resolve, reject) => {
        worker.addEventListener('message', (e) => resolve(e.data));
        worker.addEventListener('error', (e) => reject(new Error(e.message || 'bench-worker.mjs failed to start')));
        worker.postMessage(message);
      });
      if (reply.error) throw new Error(reply.error);
      return reply.records;
    } finally {
      worker.terminate();
    }
  }, { url: `/file/${encodeURIComponent(basename(file))}`, sentences, spec }));
}

const where = values.browser ? 'Chromium' : 'Node';
for (const record of await (values.browser ? inChromium() : inNode())) console.log(JSON.stringify({ ...record, where }));
