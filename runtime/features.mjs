// What this engine offers: relaxed SIMD (and how its integer dot behaves), shared memory.

// A module whose one function returns lane 0 of
//   i32x4.relaxed_dot_i8x16_i7x16_add_s(i8x16.splat(a), i8x16.splat(b), i32x4.splat(c)),
// assembled by hand (checked against wat2wasm 1.0.42). Its validation is the relaxed-SIMD feature
// test; running it is the probe. Taking a, b, c as parameters keeps the engine from folding it.
const PROBE_WASM = new Uint8Array([
  0x00, 0x61, 0x73, 0x6d, 0x01, 0x00, 0x00, 0x00, // magic, version 1
  0x01, 0x08, 0x01, 0x60, 0x03, 0x7f, 0x7f, 0x7f, 0x01, 0x7f, // type: (i32 i32 i32) -> i32
  0x03, 0x02, 0x01, 0x00, // function 0 has type 0
  0x07, 0x07, 0x01, 0x03, 0x64, 0x6f, 0x74, 0x00, 0x00, // export "dot" = function 0
  0x0a, 0x16, 0x01, 0x14, 0x00, // code: one body of 20 bytes, no locals
  0x20, 0x00, 0xfd, 0x0f, // local.get 0, i8x16.splat
  0x20, 0x01, 0xfd, 0x0f, // local.get 1, i8x16.splat
  0x20, 0x02, 0xfd, 0x11, // local.get 2, i32x4.splat
  0xfd, 0x93, 0x02, // i32x4.relaxed_dot_i8x16_i7x16_add_s (0xfd 0x113)
  0xfd, 0x1b, 0x00, // i32x4.extract_lane 0
  0x0b, // end
]);

// Lane 0 sums four products a * b. With a = -128 and b = 0xff (top bit set, outside the 7-bit
// contract) each product is 128 when b reads as signed (-1), -32640 when it reads as unsigned
// (255); x86's pmaddubsw then saturates each pair's -65280 to the i16 -32768 (XNNPACK probes
// this), VNNI's vpdpbusd does not.
const TOP_BIT = { a: -128, b: -1 };
const TOP_BIT_OUTCOMES = new Map([
  [4 * 128, { sevenBit: 'signed', saturates: false }],
  [2 * -32768, { sevenBit: 'unsigned', saturates: true }],
  [4 * -128 * 255, { sevenBit: 'unsigned', saturates: false }],
]);

/**
 * Run the relaxed integer dot on this engine. `usable` says whether it is exact inside the 7-bit
 * contract (b in 0..127, the accumulator added), which is all the kernels rely on; `sevenBit` and
 * `saturates` say what it does with b's top bit set (the kernels never do that, so their results
 * are the same whatever this finds).
 */
export async function probeRelaxedDot() {
  if (!WebAssembly.validate(PROBE_WASM)) {
    return { supported: false, usable: false, sevenBit: null, saturates: null, topBitLane: null,
      note: 'relaxed SIMD is not available (Node 20 needs --experimental-wasm-relaxed-simd)' };
  }
  const { instance } = await WebAssembly.instantiate(PROBE_WASM);
  const dot = instance.exports.dot;
  const contract = [[1, 1, 5], [-128, 127, -7], [127, 127, 0], [-3, 64, 1 << 20]];
  const usable = contract.every(([a, b, c]) => dot(a, b, c) === 4 * a * b + c);
  const topBitLane = dot(TOP_BIT.a, TOP_BIT.b, 0);
  const outcome = TOP_BIT_OUTCOMES.get(topBitLane) ?? { sevenBit: 'unknown', saturates: null };
  return {
    supported: true, usable, ...outcome, topBitLane,
    note: usable ? null
      : 'the engine gets the relaxed dot wrong inside the 7-bit contract (Node 20\'s baseline compiler, '
        + 'Liftoff, can drop the accumulator and double the dot: run node with --no-liftoff)',
  };
}

/** Shared memory is what threads need; a browser page has it only when cross-origin isolated. */
export function sharedMemoryStatus() {
  const isolated = globalThis.crossOriginIsolated;
  const sab = typeof SharedArrayBuffer === 'function';
  // Node has no crossOriginIsolated and always has SharedArrayBuffer.
  return { sharedArrayBuffer: sab, crossOriginIsolated: isolated ?? null, canThread: sab && isolated !== false };
}
