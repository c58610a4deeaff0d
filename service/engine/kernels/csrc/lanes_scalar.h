// Lanes (attention.inc) as plain C++: the reference every SIMD path matches bit for bit.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstring>

#include "kernels.h"

namespace corechat {

namespace {

// Attention's dot products are those of the bfloat16 dot product instruction (vdpbf16ps), which the
// paths without it follow with float32 FMAs in the MXCSR's flush-to-zero and denormals-are-zero
// modes: subnormal inputs count as 0, and a result whose magnitude, rounded to 24 bits with an
// unbounded exponent, is below FLT_MIN is 0 (x86 detects tininess after rounding). The plain C++
// below is that rule, the reference's.
inline float flush_subnormal(float x) {
    return std::fabs(x) < std::numeric_limits<float>::min() ? std::copysign(0.0f, x) : x;
}

// The rounded result `rounded` of an exact value `exact` (within double's precision of it), zero
// where x86's flush-to-zero makes it so.
inline float flush_tiny(float rounded, double exact) {
    constexpr float kSmallest = std::numeric_limits<float>::min();
    const float size = std::fabs(rounded);
    if (!(size <= kSmallest)) return rounded;  // normal, infinite or NaN
    // Below FLT_MIN, or FLT_MIN itself when rounding to 24 bits without a floor would land under it:
    // values under the midpoint between FLT_MIN and the float below it at an unbounded exponent.
    if (size < kSmallest || std::fabs(exact) < static_cast<double>(kSmallest) - std::ldexp(1.0, -151))
        return std::copysign(0.0f, rounded);
    return rounded;
}

// a * b + c, rounded once, in the flush-to-zero and denormals-are-zero modes.
inline float fma_flushed(float a, float b, float c) {
    a = flush_subnormal(a), b = flush_subnormal(b), c = flush_subnormal(c);
    return flush_tiny(std::fma(a, b, c), std::fma(static_cast<double>(a), static_cast<double>(b), static_cast<double>(c)));
}

struct Lanes {
    float v[16];

    static Lanes zero() { return set1(0.0f); }
    static Lanes set1(float value) {
        Lanes out;
        for (float& lane : out.v) lane = value;
        return out;
    }
    static Lanes load(const float* source) {
        Lanes out;
        std::memcpy(out.v, source, sizeof out.v);
        return out;
    }
    static Lanes load_bfloat16(const uint16_t* source) {
        Lanes out;
        for (int i = 0; i < 16; ++i) out.v[i] = bfloat16_to_float(source[i]);
        return out;
    }
    void store(float* target) const { std::memcpy(target, v, sizeof v); }
    void store_bfloat16(uint16_t* target) const {
        for (int i = 0; i < 16; ++i) target[i] = float_to_bfloat16(v[i]);
    }
    template <typename Op>
    static Lanes map(const Lanes& a, const Lanes& b, Op op) {
        Lanes out;
        for (int i = 0; i < 16; ++i) out.v[i] = op(a.v[i], b.v[i]);
        return out;
    }
    static Lanes add(const Lanes& a, const Lanes& b) { return map(a, b, [](float x, float y) { return x + y; }); }
    static Lanes sub(const Lanes& a, const Lanes& b) { return map(a, b, [](float x, float y) { return x - y; }); }
    static Lanes mul(const Lanes& a, const Lanes& b) { return map(a, b, [](float x, float y) { return x * y; }); }
    static Lanes div(const Lanes& a, const Lanes& b) { return map(a, b, [](float x, float y) { return x / y; }); }
    // a where a > b, else b: as the SIMD max instructions, which return the second operand when either is NaN.
    static Lanes max(const Lanes& a, const Lanes& b) { return map(a, b, [](float x, float y) { return x > y ? x : y; }); }
    // A query element as the score loop reads it, and 16 keys' elements 2i (even) and 2i + 1 (odd).
    using Query = float;
    static Query query(uint16_t bits) { return bfloat16_to_float(bits); }
    struct KeyPairs {
        float even[16], odd[16];
    };
    static KeyPairs load_key_pairs(const uint16_t* source) {
        KeyPairs out;
        for (int i = 0; i < 16; ++i) out.even[i] = bfloat16_to_float(source[2 * i]);
        for (int i = 0; i < 16; ++i) out.odd[i] = bfloat16_to_float(source[2 * i + 1]);
        return out;
    }
    // The pair with element 2i + 1 as 0.
    static KeyPairs even_only(KeyPairs keys) {
        for (float& lane : keys.odd) lane = 0.0f;
        return keys;
    }
    // Each lane rounded to bfloat16 (float_to_bfloat16), as a float.
    Lanes to_bfloat16() const {
        Lanes out;
        for (int i = 0; i < 16; ++i) out.v[i] = bfloat16_to_float(float_to_bfloat16(v[i]));
        return out;
    }
    static Lanes odd_of(const KeyPairs& keys) { return load(keys.odd); }
    static Lanes even_of(const KeyPairs& keys) { return load(keys.even); }
    // The dot products' modes: fma_flushed flushes by itself.
    struct Flushing {};
    static constexpr bool kPairDot = false;
    static Lanes fma_flushed(const Lanes& a, const Lanes& b, const Lanes& c) {
        Lanes out;
        for (int i = 0; i < 16; ++i) out.v[i] = corechat::fma_flushed(a.v[i], b.v[i], c.v[i]);
        return out;
    }
    static Lanes fma(const Lanes& a, const Lanes& b, const Lanes& c) {
        Lanes out;
        for (int i = 0; i < 16; ++i) out.v[i] = std::fma(a.v[i], b.v[i], c.v[i]);
        return out;
    }
    static Lanes exp_nonpositive(const Lanes& x) {
        Lanes out;
        for (int i = 0; i < 16; ++i) out.v[i] = exp_nonpositive_lane(x.v[i]);
        return out;
    }
    static Lanes nearest(const Lanes& x) {
        Lanes out;
        for (int i = 0; i < 16; ++i) out.v[i] = std::nearbyint(x.v[i]);
        return out;
    }
    static Lanes times_power_of_two(const Lanes& p, const Lanes& whole) {
        Lanes out;
        for (int i = 0; i < 16; ++i) out.v[i] = corechat::times_power_of_two(p.v[i], whole.v[i]);
        return out;
    }
    // values where x >= bound, else 0 (NaN included).
    static Lanes zero_below(const Lanes& values, const Lanes& x, const Lanes& bound) {
        Lanes out;
        for (int i = 0; i < 16; ++i) out.v[i] = x.v[i] >= bound.v[i] ? values.v[i] : 0.0f;
        return out;
    }
    // The first `count` lanes, the rest 0.
    Lanes first(int64_t count) const {
        Lanes out = *this;
        for (int64_t i = count; i < 16; ++i) out.v[i] = 0.0f;
        return out;
    }
    float sum() const { return sum_sixteen(v); }
    float largest() const { return largest_of_sixteen(v); }
};

constexpr int kScoreCombos = 4;
constexpr int kScoreRegisters = 5;
constexpr int kValueCombos = 4;
constexpr int kValueRegisters = 5;

}  // namespace

}  // namespace corechat
