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

namespace {

// One butterfly stage over 16 lanes (two of reference.cpp's runs of 8): each lane adds its partner
// (`partner`, the lanes permuted) to itself, or in the lanes of `negated` subtracts itself from its
// partner: a + b in a pair's first lane, a - b in its second. p - v is p + (-v) in IEEE arithmetic,
// so each lane has reference.cpp's stage's bits (p + v * -1).
inline __m512 stage(__m512 v, __m512 partner, __mmask16 negated) {
    return _mm512_mask_sub_ps(_mm512_add_ps(partner, v), negated, partner, v);
}

// reference.cpp's rotate_block on a block held as [runs 0 | 1] and [runs 2 | 3]: strides 1, 2 and 4
// inside each run of 8, then 8 (run 0 with 1, 2 with 3) and 16 (the two registers), the same sums.
inline void rotate_block(__m512& low, __m512& high) {
    for (__m512* half : {&low, &high}) {
        __m512 v = *half;
        v = stage(v, _mm512_permute_ps(v, 0xb1), 0xaaaa);
        v = stage(v, _mm512_permute_ps(v, 0x4e), 0xcccc);
        v = stage(v, _mm512_shuffle_f32x4(v, v, _MM_SHUFFLE(2, 3, 0, 1)), 0xf0f0);
        // Run 0 + run 1 (the same sum as 1 + 0) in the first 8 lanes, run 0 - run 1 in the last 8.
        *half = stage(v, _mm512_shuffle_f32x4(v, v, _MM_SHUFFLE(1, 0, 3, 2)), 0xff00);
    }
    const __m512 first = low;
    low = _mm512_add_ps(first, high);
    high = _mm512_sub_ps(first, high);
}

inline __m512 widened(const uint16_t* bits) {
    const __m512i words = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(bits)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(words, 16));
}

}  // namespace

// reference.cpp's quantize_rows on 16 lanes a register, a block in two: every step the same IEEE
// operation on the same values (the rotation's sums, the largest magnitude's bits, the block's step
// and its inverse, each value times the inverse, rounded by adding and subtracting 1.5 * 2^23 and
// clamped), so the same bits; the block's scale and step come from kernels.h's block_scale, as there.
void quantize_rows_avx512(const void* source, bool bfloat16, bool rotated, int64_t stride, int64_t begin, int64_t end,
                          int8_t* values, float* scales, int32_t* sums, int64_t cols) {
    const __m512 magic = _mm512_set1_ps(12582912.0f), lowest = _mm512_set1_ps(-127.0f), highest = _mm512_set1_ps(127.0f);
    const __m512i magnitude = _mm512_set1_epi32(0x7fffffff);
    const int64_t blocks = cols / kBlock;
    for (int64_t row = begin; row < end; ++row) {
        for (int64_t b = 0; b < blocks; ++b) {
            const int64_t first = row * stride + b * kBlock;
            __m512 low, high;
            if (bfloat16) {
                const uint16_t* bits = static_cast<const uint16_t*>(source) + first;
                low = widened(bits);
                high = widened(bits + 16);
            } else {
                low = _mm512_loadu_ps(static_cast<const float*>(source) + first);
                high = _mm512_loadu_ps(static_cast<const float*>(source) + first + 16);
            }
            if (rotated) rotate_block(low, high);
            const uint32_t top = _mm512_reduce_max_epu32(_mm512_max_epu32(
                _mm512_and_si512(_mm512_castps_si512(low), magnitude), _mm512_and_si512(_mm512_castps_si512(high), magnitude)));
            int8_t* out = values + row * cols + b * kBlock;
            float scale, step_inverse;
            int32_t sum = 0;
            if (!block_scale(top, rotated, scale, step_inverse)) {
                std::memset(out, 0, kBlock);
            } else {
                const __m512 inverse = _mm512_set1_ps(step_inverse);
                __m512i whole[2];
                int half = 0;
                for (const __m512 run : {low, high}) {
                    __m512 level = _mm512_sub_ps(_mm512_add_ps(_mm512_mul_ps(run, inverse), magic), magic);
                    level = _mm512_min_ps(_mm512_max_ps(level, lowest), highest);
                    whole[half] = _mm512_cvttps_epi32(level);
                    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 16 * half), _mm512_cvtepi32_epi8(whole[half]));
                    ++half;
                }
                sum = _mm512_reduce_add_epi32(_mm512_add_epi32(whole[0], whole[1]));
            }
            scales[row * blocks + b] = scale;
            sums[row * blocks + b] = sum;
        }
    }
}

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
