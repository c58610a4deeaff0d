// The AVX-512 VNNI path, for CPUs with AVX-512 F, BW, VL and VNNI: the product (512-bit vpdpbusd,
// 16 outputs to a register) and the paged attention on 512-bit vectors.
#define CORECHAT_MATMUL matmul_avx512_vnni
#define CORECHAT_VNNI 1
#include "matmul_x86.inc"

#include "lanes_avx512.h"
#define CORECHAT_ATTEND attend_avx512
#define CORECHAT_ATTEND_PART attend_part_avx512
#include "attention.inc"
#define CORECHAT_TOKEN_WEIGHTS token_weights_avx512
#include "weights.inc"

namespace corechat {

// The peak multiply-add rate's probe (bench/probes/prompt_probe.py): nothing but 512-bit vpdpbusd
// on twelve independent accumulators, which no product can beat on this path. Returns a sum so it
// is not elided.
int64_t peak_loop_avx512(int64_t iterations) {
    __m512i acc[kPeakLanesAvx512];
    for (auto& lane : acc) lane = _mm512_setzero_si512();
    __m512i ones = _mm512_set1_epi8(1), twos = _mm512_set1_epi8(2);
    for (int64_t i = 0; i < iterations; ++i) {
        asm volatile("" : "+v"(ones), "+v"(twos));
        for (auto& lane : acc) lane = _mm512_dpbusd_epi32(lane, ones, twos);
    }
    __m512i total = acc[0];
    for (int k = 1; k < kPeakLanesAvx512; ++k) total = _mm512_add_epi32(total, acc[k]);
    return _mm512_reduce_add_epi32(total);
}

}  // namespace corechat
