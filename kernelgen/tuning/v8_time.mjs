// The tuner's timings in V8 (kernelgen tune --engine node|both): one kernel call, timed as
// browsers would run it, on a copy of the memory the tuner set up under wasmtime.
// Started by kernelgen/tuning/v8.py as
//   node --experimental-wasm-relaxed-simd --no-liftoff v8_time.mjs CONFIG_JSON
// with CONFIG_JSON {wasm, image, minPages, maxPages, export, args}: `wasm` the variant's module (its
// repeat wrapper included), `image` a file holding the memory's bytes from address 0, `export` the
// repeat wrapper (called as export(reps, ...args)). Prints "ready", then for each line of stdin
// holding a repetition count runs one batch and prints the process's CPU seconds it took (the batch
// runs on this thread alone; --no-liftoff compiled everything before the first batch).

import { readFile } from 'node:fs/promises';
import { createInterface } from 'node:readline';

const config = JSON.parse(process.argv[2]);
const memory = new WebAssembly.Memory({ initial: config.minPages, maximum: config.maxPages, shared: true });
const image = await readFile(config.image);
if (image.length > memory.buffer.byteLength) memory.grow(Math.ceil((image.length - memory.buffer.byteLength) / 65536));
new Uint8Array(memory.buffer).set(image);
const { instance } = await WebAssembly.instantiate(await readFile(config.wasm), { env: { memory } });
const kernel = instance.exports[config.export];
if (typeof kernel !== 'function') throw new Error(`no export ${config.export}`);

console.log('ready');
for await (const line of createInterface({ input: process.stdin })) {
  const reps = Number.parseInt(line, 10);
  const t0 = process.cpuUsage();
  kernel(reps, ...config.args);
  const dt = process.cpuUsage(t0);
  console.log(String((dt.user + dt.system) / 1e6));
}
