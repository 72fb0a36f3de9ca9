;; The bench's peer: a Q8_0 mat-vec written by hand the way the seed documents' engine.wat does it
;; (SIMD128 only), so `kernelgen bench` can say whether the generated kernels beat it.
;;
;; - The int8 activations (quantize_act's simd128 form, one f32 scale per 32) are widened to i16
;;   once per call into a scratch buffer `xw` (2 bytes per value; it stays in L1 for k <= 16384).
;; - One row per pass; each block of 32 weights is sign-extended in two halves per 16 bytes and
;;   multiplied with the i16 activations by four i32x4.dot_i16x8_s, the exact i32 sums are then
;;   converted and scaled by weight scale * activation scale into one f32x4 accumulator.
;; - Weights are the planes kernelgen packs: `wq` int8 codes row-major (k bytes per row) and `ws`
;;   one f32 scale per block, so the peer reads the same bytes as the generated kernel.
;;
;; It imports the kernel module's shared memory, so both read the same buffers.
(module
  (import "env" "memory" (memory 1 32768 shared))

  ;;   wq: i8[n, k]  ws: f32[n, k / 32]  aq: i8[k]  ad: f32[k / 32]
  ;;   xw: i16[k] scratch  y: f32[n] written  n: rows  k: row length, a multiple of 32
  (func $seed_qmatvec (export "seed_qmatvec")
    (param $wq i32) (param $ws i32) (param $aq i32) (param $ad i32) (param $xw i32) (param $y i32)
    (param $n i32) (param $k i32)
    (local $i i32) (local $r i32) (local $x i32) (local $xs i32) (local $xend i32)
    (local $a v128) (local $d v128) (local $acc v128)
    ;; activations widened to i16, once per call
    (local.set $i (i32.const 0))
    (block $widened
      (loop $widen
        (br_if $widened (i32.ge_u (local.get $i) (local.get $k)))
        (local.set $a (v128.load (i32.add (local.get $aq) (local.get $i))))
        (local.set $x (i32.add (local.get $xw) (i32.shl (local.get $i) (i32.const 1))))
        (v128.store (local.get $x) (i16x8.extend_low_i8x16_s (local.get $a)))
        (v128.store offset=16 (local.get $x) (i16x8.extend_high_i8x16_s (local.get $a)))
        (local.set $i (i32.add (local.get $i) (i32.const 16)))
        (br $widen)))
    (local.set $xend (i32.add (local.get $xw) (i32.shl (local.get $k) (i32.const 1))))
    ;; one row per pass
    (local.set $r (i32.const 0))
    (block $rows_done
      (loop $rows
        (br_if $rows_done (i32.ge_u (local.get $r) (local.get $n)))
        (local.set $acc (v128.const f32x4 0 0 0 0))
        (local.set $x (local.get $xw))
        (local.set $xs (local.get $ad))
        (block $blocks_done
          (loop $blocks
            (br_if $blocks_done (i32.ge_u (local.get $x) (local.get $xend)))
            (local.set $a (v128.load (local.get $wq)))
            (local.set $d (i32x4.add
              (i32x4.dot_i16x8_s (i16x8.extend_low_i8x16_s (local.get $a)) (v128.load (local.get $x)))
              (i32x4.dot_i16x8_s (i16x8.extend_high_i8x16_s (local.get $a)) (v128.load offset=16 (local.get $x)))))
            (local.set $a (v128.load offset=16 (local.get $wq)))
            (local.set $d (i32x4.add (local.get $d) (i32x4.add
              (i32x4.dot_i16x8_s (i16x8.extend_low_i8x16_s (local.get $a)) (v128.load offset=32 (local.get $x)))
              (i32x4.dot_i16x8_s (i16x8.extend_high_i8x16_s (local.get $a)) (v128.load offset=48 (local.get $x))))))
            (local.set $acc (f32x4.add (local.get $acc)
              (f32x4.mul (f32x4.convert_i32x4_s (local.get $d))
                         (f32x4.splat (f32.mul (f32.load (local.get $ws)) (f32.load (local.get $xs)))))))
            (local.set $wq (i32.add (local.get $wq) (i32.const 32)))
            (local.set $ws (i32.add (local.get $ws) (i32.const 4)))
            (local.set $x (i32.add (local.get $x) (i32.const 64)))
            (local.set $xs (i32.add (local.get $xs) (i32.const 4)))
            (br $blocks)))
        (f32.store (i32.add (local.get $y) (i32.shl (local.get $r) (i32.const 2)))
          (f32.add
            (f32.add (f32x4.extract_lane 0 (local.get $acc)) (f32x4.extract_lane 1 (local.get $acc)))
            (f32.add (f32x4.extract_lane 2 (local.get $acc)) (f32x4.extract_lane 3 (local.get $acc)))))
        (local.set $r (i32.add (local.get $r) (i32.const 1)))
        (br $rows))))

  ;; seed_qmatvec called reps times: timed inside wasm like the generated kernels.
  (func (export "seed_qmatvec_repeat")
    (param $reps i32) (param $wq i32) (param $ws i32) (param $aq i32) (param $ad i32) (param $xw i32)
    (param $y i32) (param $n i32) (param $k i32)
    (block $done
      (loop $again
        (br_if $done (i32.le_s (local.get $reps) (i32.const 0)))
        (call $seed_qmatvec (local.get $wq) (local.get $ws) (local.get $aq) (local.get $ad) (local.get $xw)
                            (local.get $y) (local.get $n) (local.get $k))
        (local.set $reps (i32.sub (local.get $reps) (i32.const 1)))
        (br $again)))))
