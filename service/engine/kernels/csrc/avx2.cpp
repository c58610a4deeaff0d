// The AVX2 path, for x86-64 CPUs with AVX2, FMA and F16C: the product (maddubs + madd, one tile of
// 16 outputs at a time: 16 vector registers) and the paged attention.
#define CORECHAT_MATMUL matmul_avx2
#define CORECHAT_VNNI 0
#include "matmul_x86.inc"

#include "lanes_avx2.h"
#define CORECHAT_ATTEND attend_avx2
#include "attention.inc"

namespace corechat {

// The peak multiply-add rate's probe on AVX2: the product's own maddubs, madd and add per 32 byte
// pairs, on eight independent accumulators. Returns a sum so it is not elided.
int64_t peak_loop_avx2(int64_t iterations) {
    __m256i acc[8];
    for (auto& lane : acc) lane = _mm256_setzero_si256();
    __m256i ones = _mm256_set1_epi8(1), twos = _mm256_set1_epi8(2);
    const __m256i words = _mm256_set1_epi16(1);
    for (int64_t i = 0; i < iterations; ++i) {
        asm volatile("" : "+x"(ones), "+x"(twos));
        for (auto& lane : acc) lane = _mm256_add_epi32(lane, _mm256_madd_epi16(_mm256_maddubs_epi16(ones, twos), words));
    }
    __m256i total = acc[0];
    for (int k = 1; k < 8; ++k) total = _mm256_add_epi32(total, acc[k]);
    alignas(32) int32_t lanes[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), total);
    int64_t sum = 0;
    for (int32_t lane : lanes) sum += lane;
    return sum;
}

}  // namespace corechat
