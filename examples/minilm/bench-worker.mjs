// bench.mjs --browser's engine thread: the page starts this dedicated worker and posts it {url,
// sentences, spec}; it fetches the engine's file, builds the engine (timing.mjs), times it and posts
// {records} or {error}. Both engines run in a worker, as pages run models: kernelgen's driver runs
// right here (a dedicated worker may block), so its calls cross no thread; onnxruntime-web starts
// its own threads from here. Paths are those bench.mjs serves.

import { kernelgenEngine, ortEngine, timeEngine } from './timing.mjs';

self.addEventListener('message', async ({ data: { url, sentences, spec } }) => {
  try {
    const bytes = new Uint8Array(await (await fetch(url)).arrayBuffer());
    let engine;
    if (spec.engine === 'kernelgen') {
      const { loadKernels } = await import('/runtime/kernelgen.mjs');
      engine = await kernelgenEngine(loadKernels, bytes, spec);
    } else {
      const ort = await import('/ort/ort.wasm.min.mjs');
      ort.env.wasm.wasmPaths = '/ort/';
      engine = await ortEngine(ort, bytes, spec);
    }
    try {
      self.postMessage({ records: await timeEngine(engine, sentences, spec.batches, spec.repeat) });
    } finally {
      await engine.close();
    }
  } catch (e) {
    self.postMessage({ error: String(e?.stack ?? e) });
  }
});
