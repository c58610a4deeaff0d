// Lanes (attention.inc) as two AVX2 registers, each operation the scalar one lane by lane.
#pragma once

#include <immintrin.h>

#include "kernels.h"
#include "mxcsr.h"

namespace corechat {

namespace {

struct Lanes {
    __m256 low, high;

    static Lanes zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
    static Lanes set1(float value) { return {_mm256_set1_ps(value), _mm256_set1_ps(value)}; }
    static Lanes load(const float* source) { return {_mm256_loadu_ps(source), _mm256_loadu_ps(source + 8)}; }
    static __m256 widen(const uint16_t* source) {
        const __m256i words = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(source)));
        return _mm256_castsi256_ps(_mm256_slli_epi32(words, 16));
    }
    static Lanes load_bfloat16(const uint16_t* source) { return {widen(source), widen(source + 8)}; }
    void store(float* target) const {
        _mm256_storeu_ps(target, low);
        _mm256_storeu_ps(target + 8, high);
    }
    // float_to_bfloat16 on 8 lanes, each in its lane's low half: round to nearest even, a NaN kept quiet.
    static __m256i rounded_bits(__m256 values) {
        const __m256i bits = _mm256_castps_si256(values);
        const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
        const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(bits, _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff))), 16);
        const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(0x40));
        const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(values, values, _CMP_UNORD_Q));
        return _mm256_blendv_epi8(rounded, quiet, nan);
    }
    static __m128i narrow(__m256 values) {
        const __m256i chosen = rounded_bits(values);
        const __m256i packed = _mm256_packus_epi32(chosen, chosen);  // within each 128-bit half
        return _mm256_castsi256_si128(_mm256_permute4x64_epi64(packed, 0x08));
    }
    void store_bfloat16(uint16_t* target) const {
        _mm_storeu_si128(reinterpret_cast<__m128i*>(target), narrow(low));
        _mm_storeu_si128(reinterpret_cast<__m128i*>(target + 8), narrow(high));
    }
    static Lanes add(const Lanes& a, const Lanes& b) { return {_mm256_add_ps(a.low, b.low), _mm256_add_ps(a.high, b.high)}; }
    static Lanes sub(const Lanes& a, const Lanes& b) { return {_mm256_sub_ps(a.low, b.low), _mm256_sub_ps(a.high, b.high)}; }
    static Lanes mul(const Lanes& a, const Lanes& b) { return {_mm256_mul_ps(a.low, b.low), _mm256_mul_ps(a.high, b.high)}; }
    static Lanes div(const Lanes& a, const Lanes& b) { return {_mm256_div_ps(a.low, b.low), _mm256_div_ps(a.high, b.high)}; }
    static Lanes max(const Lanes& a, const Lanes& b) { return {_mm256_max_ps(a.low, b.low), _mm256_max_ps(a.high, b.high)}; }
    // A query element as the score loop reads it, and 16 keys' elements 2i and 2i + 1 (keys 0-7 and
    // 8-15, a key's pair in each 32-bit lane: element 2i + 1 the high half).
    using Query = float;
    static Query query(uint16_t bits) { return bfloat16_to_float(bits); }
    struct KeyPairs {
        __m256i low, high;
    };
    static KeyPairs load_key_pairs(const uint16_t* source) {
        return {_mm256_loadu_si256(reinterpret_cast<const __m256i*>(source)),
                _mm256_loadu_si256(reinterpret_cast<const __m256i*>(source + 16))};
    }
    // The pair with element 2i + 1 as 0.
    static KeyPairs even_only(const KeyPairs& keys) {
        const __m256i low_half = _mm256_set1_epi32(0xffff);
        return {_mm256_and_si256(keys.low, low_half), _mm256_and_si256(keys.high, low_half)};
    }
    // Each lane rounded to bfloat16 (float_to_bfloat16), as a float.
    Lanes to_bfloat16() const {
        return {_mm256_castsi256_ps(_mm256_slli_epi32(rounded_bits(low), 16)),
                _mm256_castsi256_ps(_mm256_slli_epi32(rounded_bits(high), 16))};
    }
    // The dot products' modes (mxcsr.h).
    using Flushing = MxcsrFlushing;
    static Lanes odd_of(const KeyPairs& keys) {
        const __m256i high = _mm256_set1_epi32(static_cast<int>(0xffff0000u));
        return {_mm256_castsi256_ps(_mm256_and_si256(keys.low, high)),
                _mm256_castsi256_ps(_mm256_and_si256(keys.high, high))};
    }
    static Lanes even_of(const KeyPairs& keys) {
        return {_mm256_castsi256_ps(_mm256_slli_epi32(keys.low, 16)),
                _mm256_castsi256_ps(_mm256_slli_epi32(keys.high, 16))};
    }
    static constexpr bool kPairDot = false;
    // a * b + c in Flushing's modes (within its scope).
    static Lanes fma_flushed(const Lanes& a, const Lanes& b, const Lanes& c) { return fma(a, b, c); }
    static Lanes fma(const Lanes& a, const Lanes& b, const Lanes& c) {
        return {_mm256_fmadd_ps(a.low, b.low, c.low), _mm256_fmadd_ps(a.high, b.high, c.high)};
    }
    // exp_nonpositive_lane (kernels.h) on 8 lanes: its operations, one by one.
    static __m256 exp8(__m256 x) {
        x = _mm256_max_ps(_mm256_set1_ps(-87.0f), x);
        const __m256 magic = _mm256_set1_ps(12582912.0f);
        const __m256 whole = _mm256_sub_ps(_mm256_add_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2E)), magic), magic);
        x = _mm256_sub_ps(x, _mm256_mul_ps(whole, _mm256_set1_ps(0.693359375f)));
        x = _mm256_sub_ps(x, _mm256_mul_ps(whole, _mm256_set1_ps(-2.12194440e-4f)));
        __m256 y = _mm256_set1_ps(1.9875691500e-4f);
        y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507e-3f));
        y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073e-3f));
        y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894e-2f));
        y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459e-1f));
        y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201e-1f));
        y = _mm256_add_ps(_mm256_fmadd_ps(y, _mm256_mul_ps(x, x), x), _mm256_set1_ps(1.0f));
        const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvttps_epi32(whole), _mm256_set1_epi32(127)), 23);
        return _mm256_mul_ps(y, _mm256_castsi256_ps(bits));
    }
    static Lanes exp_nonpositive(const Lanes& x) { return {exp8(x.low), exp8(x.high)}; }
    // Each lane rounded to the nearest integer, half to even.
    static Lanes nearest(const Lanes& x) {
        constexpr int kMode = _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC;
        return {_mm256_round_ps(x.low, kMode), _mm256_round_ps(x.high, kMode)};
    }
    // p * 2^whole for integral `whole` in -125..0, the power's bits built from it; a NaN lane's
    // power is 1.0 (cvtps gives INT32_MIN, whose bits shifted make 1.0), so p stays that NaN.
    static __m256 times_power8(__m256 p, __m256 whole) {
        const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(whole), _mm256_set1_epi32(127)), 23);
        return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
    }
    static Lanes times_power_of_two(const Lanes& p, const Lanes& whole) {
        return {times_power8(p.low, whole.low), times_power8(p.high, whole.high)};
    }
    // values where x >= bound, else 0 (NaN included).
    static Lanes zero_below(const Lanes& values, const Lanes& x, const Lanes& bound) {
        return {_mm256_and_ps(values.low, _mm256_cmp_ps(x.low, bound.low, _CMP_GE_OQ)),
                _mm256_and_ps(values.high, _mm256_cmp_ps(x.high, bound.high, _CMP_GE_OQ))};
    }
    Lanes first(int64_t count) const {
        const __m256i index = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
        const __m256 keep_low = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(count)), index));
        const __m256 keep_high = _mm256_castsi256_ps(
            _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(count) - 8), index));
        return {_mm256_and_ps(low, keep_low), _mm256_and_ps(high, keep_high)};
    }
    float sum() const {
        alignas(32) float lanes[16];
        store(lanes);
        return sum_sixteen(lanes);
    }
    float largest() const {
        alignas(32) float lanes[16];
        store(lanes);
        return largest_of_sixteen(lanes);
    }
};

// 16 registers, a broadcast query element or weight in one: score accumulators and their key
// blocks in 14 (7 Lanes), value accumulators and the value lanes they weigh in 14.
constexpr int kScoreCombos = 6;
constexpr int kScoreRegisters = 7;
constexpr int kValueCombos = 6;
constexpr int kValueRegisters = 7;

}  // namespace

}  // namespace corechat
