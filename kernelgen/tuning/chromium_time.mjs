// The tuner's timings in Chromium (kernelgen tune --engine chromium|all): v8_time.mjs's protocol in
// a page of headless Chromium (chromium_page.mjs), the V8 browsers ship. Started by
// kernelgen/tuning/v8.py as
//   node chromium_time.mjs CONFIG_JSON
// with v8_time.mjs's CONFIG_JSON {wasm, image, minPages, maxPages, export, args} plus `chromium`
// (the browser's executable) and `runtimeDir` (runtime/, for its server); `wasm` and `image` lie in
// one directory, which the page is served from. Prints "ready" once the page holds the module
// over a copy of the memory, then for each line of stdin holding a repetition count runs one batch
// on the page's thread and prints the seconds it took by the page's clock (a browser gives no CPU
// time; the page is cross-origin isolated, so its clock is not coarsened to 100 us).

import { basename, dirname } from 'node:path';
import { createInterface } from 'node:readline';

import { withChromiumPage } from './chromium_page.mjs';

const config = JSON.parse(process.argv[2]);
const dir = dirname(config.wasm);
if (dirname(config.image) !== dir) throw new Error('wasm and image must lie in one directory');
await withChromiumPage({ chromium: config.chromium, runtimeDir: config.runtimeDir, mounts: {}, pageDir: dir, pagePrefix: '/case/' },
  async (page) => {
    await page.evaluate(async (c) => {
      const fetched = async (name) => new Uint8Array(await (await fetch(`/case/${name}`)).arrayBuffer());
      const memory = new WebAssembly.Memory({ initial: c.minPages, maximum: c.maxPages, shared: true });
      const image = await fetched(c.image);
      if (image.length > memory.buffer.byteLength) memory.grow(Math.ceil((image.length - memory.buffer.byteLength) / 65536));
      new Uint8Array(memory.buffer).set(image);
      const { instance } = await WebAssembly.instantiate(await fetched(c.wasm), { env: { memory } });
      const kernel = instance.exports[c.export];
      if (typeof kernel !== 'function') throw new Error(`no export ${c.export}`);
      globalThis.batch = (reps) => {
        const t0 = performance.now();
        kernel(reps, ...c.args);
        return (performance.now() - t0) / 1e3;
      };
    }, { ...config, wasm: basename(config.wasm), image: basename(config.image) });
    console.log('ready');
    for await (const line of createInterface({ input: process.stdin })) {
      console.log(String(await page.evaluate((reps) => globalThis.batch(reps), Number.parseInt(line, 10))));
    }
  });
