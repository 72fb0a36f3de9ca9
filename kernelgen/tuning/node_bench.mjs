// `kernelgen bench --engine node`: the mat-vec and GEMM rows (bench_rows.mjs) in Node. Started by
// kernelgen/tuning/bench.py as
//   node --experimental-wasm-relaxed-simd --no-liftoff node_bench.mjs CONFIG_JSON
// with bench_rows.mjs's config (file: URLs). Prints one JSON object: {engine, target, rows}.

import { benchRows } from './bench_rows.mjs';

const result = await benchRows(JSON.parse(process.argv[2]));
console.log(JSON.stringify({ engine: `node ${process.versions.node} (V8 ${process.versions.v8})`, ...result }));
