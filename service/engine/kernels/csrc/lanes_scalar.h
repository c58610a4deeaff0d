// Lanes (attention.inc) as plain C++: the reference every SIMD path matches bit for bit.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstring>

#include "kernels.h"

namespace corechat {

namespace {

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
    // The dot products' modes: the reference's operations below flush by themselves.
    struct Flushing {};
    // acc[n][b] += the query's elements 2i + 1 then 2i (at q + n * stride) times keys[b]'s, each an
    // fma_flushed: vdpbf16ps's chain.
    template <int Count, int Blocks>
    static void dot_pairs(Lanes (&acc)[Count][Blocks], const Query* q, int64_t stride, const KeyPairs (&keys)[Blocks]) {
        for (int n = 0; n < Count; ++n)
            for (int b = 0; b < Blocks; ++b)
                for (int i = 0; i < 16; ++i) {
                    float& lane = acc[n][b].v[i];
                    lane = fma_flushed(q[n * stride + 1], keys[b].odd[i], lane);
                    lane = fma_flushed(q[n * stride], keys[b].even[i], lane);
                }
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
