// Lanes (attention.inc) as one AVX-512 register, each operation the scalar one lane by lane.
#pragma once

#include <immintrin.h>

#include <cstring>

#include "kernels.h"
#include "mxcsr.h"

namespace corechat {

namespace {

struct Lanes {
    __m512 v;

    static Lanes zero() { return {_mm512_setzero_ps()}; }
    static Lanes set1(float value) { return {_mm512_set1_ps(value)}; }
    static Lanes load(const float* source) { return {_mm512_loadu_ps(source)}; }
    static Lanes load_bfloat16(const uint16_t* source) {
        const __m512i words = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(source)));
        return {_mm512_castsi512_ps(_mm512_slli_epi32(words, 16))};
    }
    void store(float* target) const { _mm512_storeu_ps(target, v); }
    // float_to_bfloat16 on 16 lanes, each in its lane's low half: round to nearest even, a NaN kept
    // quiet (vcvtneps2bf16 would flush subnormals, which torch does not).
    __m512i rounded_bits() const {
        const __m512i bits = _mm512_castps_si512(v);
        const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
        const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16);
        const __m512i quiet = _mm512_or_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(0x40));
        const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        return _mm512_mask_blend_epi32(nan, rounded, quiet);
    }
    void store_bfloat16(uint16_t* target) const {
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(target), _mm512_cvtepi32_epi16(rounded_bits()));
    }
    // Each lane rounded to bfloat16 (float_to_bfloat16), as a float.
    Lanes to_bfloat16() const { return {_mm512_castsi512_ps(_mm512_slli_epi32(rounded_bits(), 16))}; }
    static Lanes add(const Lanes& a, const Lanes& b) { return {_mm512_add_ps(a.v, b.v)}; }
    static Lanes sub(const Lanes& a, const Lanes& b) { return {_mm512_sub_ps(a.v, b.v)}; }
    static Lanes mul(const Lanes& a, const Lanes& b) { return {_mm512_mul_ps(a.v, b.v)}; }
    static Lanes div(const Lanes& a, const Lanes& b) { return {_mm512_div_ps(a.v, b.v)}; }
    static Lanes max(const Lanes& a, const Lanes& b) { return {_mm512_max_ps(a.v, b.v)}; }
    static Lanes fma(const Lanes& a, const Lanes& b, const Lanes& c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
    // 16 keys' elements 2i and 2i + 1, a key's pair in each 32-bit lane (element 2i + 1 the high half).
    using KeyPairs = __m512i;
    static KeyPairs load_key_pairs(const uint16_t* source) { return _mm512_loadu_si512(source); }
    // The pair with element 2i + 1 as 0.
    static KeyPairs even_only(const KeyPairs& keys) { return _mm512_and_si512(keys, _mm512_set1_epi32(0xffff)); }
    static Lanes odd_of(const KeyPairs& keys) {
        return {_mm512_castsi512_ps(_mm512_and_si512(keys, _mm512_set1_epi32(static_cast<int>(0xffff0000u))))};
    }
    static Lanes even_of(const KeyPairs& keys) { return {_mm512_castsi512_ps(_mm512_slli_epi32(keys, 16))}; }
#ifdef CORECHAT_BF16_DOT
    // The dot products' modes: vdpbf16ps has them whatever the MXCSR says.
    struct Flushing {};
    static constexpr bool kPairDot = true;
    // A query element as its bfloat16 bits: elements 2i and 2i + 1 broadcast as one 32-bit lane.
    using Query = uint16_t;
    static Query query(uint16_t bits) { return bits; }
    // The lanes rounded to bfloat16, their bits stored; returns them rounded (one rounding for both).
    // vcvtneps2bf16 rounds as float_to_bfloat16 does but for subnormals, which it flushes: the lanes
    // are attention's weights, normal (pow2_weight_lane's floor), 0 or NaN.
    static Lanes store_rounded(const Lanes& lanes, uint16_t* target) {
        const __m256i bits = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(lanes.v));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(target), bits);
        return {_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16))};
    }
    // acc[n][b] += the query's elements 2i + 1 then 2i (at q + n * stride) times keys[b]'s: one
    // vdpbf16ps.
    template <int Count, int Blocks>
    static void dot_pairs(Lanes (&acc)[Count][Blocks], const Query* q, int64_t stride, const KeyPairs (&keys)[Blocks]) {
#pragma GCC unroll 16
        for (int n = 0; n < Count; ++n) {
            uint32_t pair;
            std::memcpy(&pair, q + n * stride, sizeof pair);
            const __m512bh element = reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(pair)));
            for (int b = 0; b < Blocks; ++b)
                acc[n][b] = {_mm512_dpbf16_ps(acc[n][b].v, reinterpret_cast<__m512bh>(keys[b]), element)};
        }
    }
#else
    // The dot products' modes (mxcsr.h).
    using Flushing = MxcsrFlushing;
    static constexpr bool kPairDot = false;
    using Query = float;
    static Query query(uint16_t bits) { return bfloat16_to_float(bits); }
    // a * b + c in Flushing's modes (within its scope).
    static Lanes fma_flushed(const Lanes& a, const Lanes& b, const Lanes& c) { return fma(a, b, c); }
#endif
    // exp_nonpositive_lane (kernels.h) on 16 lanes: its operations, one by one.
    static Lanes exp_nonpositive(const Lanes& lanes) {
        __m512 x = _mm512_max_ps(_mm512_set1_ps(-87.0f), lanes.v);
        const __m512 magic = _mm512_set1_ps(12582912.0f);
        const __m512 whole = _mm512_sub_ps(_mm512_add_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2E)), magic), magic);
        x = _mm512_sub_ps(x, _mm512_mul_ps(whole, _mm512_set1_ps(0.693359375f)));
        x = _mm512_sub_ps(x, _mm512_mul_ps(whole, _mm512_set1_ps(-2.12194440e-4f)));
        __m512 y = _mm512_set1_ps(1.9875691500e-4f);
        y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.3981999507e-3f));
        y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(8.3334519073e-3f));
        y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(4.1665795894e-2f));
        y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(1.6666665459e-1f));
        y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(5.0000001201e-1f));
        y = _mm512_add_ps(_mm512_fmadd_ps(y, _mm512_mul_ps(x, x), x), _mm512_set1_ps(1.0f));
        const __m512i bits = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvttps_epi32(whole), _mm512_set1_epi32(127)), 23);
        return {_mm512_mul_ps(y, _mm512_castsi512_ps(bits))};
    }
    // Each lane rounded to the nearest integer, half to even.
    static Lanes nearest(const Lanes& x) { return {_mm512_roundscale_ps(x.v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)}; }
    // p * 2^whole for integral `whole` (vscalefps: what the power's bits give; a NaN p stays that NaN).
    static Lanes times_power_of_two(const Lanes& p, const Lanes& whole) { return {_mm512_scalef_ps(p.v, whole.v)}; }
    // values where x >= bound, else 0 (NaN included).
    static Lanes zero_below(const Lanes& values, const Lanes& x, const Lanes& bound) {
        return {_mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x.v, bound.v, _CMP_GE_OQ), values.v)};
    }
    Lanes first(int64_t count) const {
        const __mmask16 keep = count >= 16 ? static_cast<__mmask16>(0xffff) : static_cast<__mmask16>((1u << count) - 1);
        return {_mm512_maskz_mov_ps(keep, v)};
    }
    float sum() const {
        alignas(64) float lanes[16];
        store(lanes);
        return sum_sixteen(lanes);
    }
    float largest() const {
        alignas(64) float lanes[16];
        store(lanes);
        return largest_of_sixteen(lanes);
    }
};

// 32 registers, the query element and the weight each an FMA's broadcast memory operand: score
// accumulators and their key blocks in 30, value accumulators and the value lanes they weigh in 30.
constexpr int kScoreCombos = 14;
constexpr int kScoreRegisters = 30;
constexpr int kValueCombos = 8;
constexpr int kValueRegisters = 30;

}  // namespace

}  // namespace corechat
