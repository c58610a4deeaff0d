// The AVX2 path, for x86-64 CPUs with AVX2, FMA and F16C: the product (maddubs + madd, one tile of
// 16 outputs at a time: 16 vector registers) and the paged attention.
#define CORECHAT_MATMUL matmul_avx2
#define CORECHAT_VNNI 0
#include "matmul_x86.inc"

#include "lanes_avx2.h"
#define CORECHAT_ATTEND attend_avx2
#define CORECHAT_ATTEND_PART attend_part_avx2
#include "attention.inc"
#define CORECHAT_TOKEN_WEIGHTS token_weights_avx2
#include "weights.inc"

namespace corechat {

// The peak multiply-add rate's probe on AVX2: the product's own maddubs, madd and add per 32 byte
// pairs, on kPeakLanesAvx2 independent accumulators, each with its own operand that an empty asm
// makes unknown every round (with one shared operand the compiler computes the maddubs and madd
// once a round for every lane). Returns a sum so it is not elided.
int64_t peak_loop_avx2(int64_t iterations) {
    __m256i acc[kPeakLanesAvx2], operand[kPeakLanesAvx2];
    for (int k = 0; k < kPeakLanesAvx2; ++k) {
        acc[k] = _mm256_setzero_si256();
        operand[k] = _mm256_set1_epi8(static_cast<char>(1 + k));
    }
    const __m256i twos = _mm256_set1_epi8(2), words = _mm256_set1_epi16(1);
    for (int64_t i = 0; i < iterations; ++i) {
        for (auto& lane : operand) asm volatile("" : "+x"(lane));
        for (int k = 0; k < kPeakLanesAvx2; ++k)
            acc[k] = _mm256_add_epi32(acc[k], _mm256_madd_epi16(_mm256_maddubs_epi16(operand[k], twos), words));
    }
    __m256i total = acc[0];
    for (int k = 1; k < kPeakLanesAvx2; ++k) total = _mm256_add_epi32(total, acc[k]);
    alignas(32) int32_t lanes[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), total);
    int64_t sum = 0;
    for (int32_t lane : lanes) sum += lane;
    return sum;
}

}  // namespace corechat
