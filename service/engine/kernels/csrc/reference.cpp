// The plain C++ reference every instruction-set path must match bit for bit, and the activation
// rounding they all share. Built without instruction-set flags: it runs on any x86-64.
#include <algorithm>
#include <cmath>
#include <limits>

#include "kernels.h"

namespace corechat {

namespace {

// Round half to even without libm: adding and subtracting 1.5 * 2^23 leaves the nearest integer
// for |value| < 2^22 under the default rounding mode, and vectorizes on plain SSE2.
inline float round_half_even(float value) {
    constexpr float kMagic = 12582912.0f;
    return (value + kMagic) - kMagic;
}

// The stored nibble (weight + 8) of element `element` of group `group` of a row.
inline int32_t int4_nibble(const Weights& w, int64_t row, int64_t group, int64_t element) {
    uint8_t packed = weight_unit(w, row, group / 2)[element];
    return group % 2 == 0 ? (packed & 0x0f) : (packed >> 4);
}

}  // namespace

void quantize_rows(const void* source, bool bfloat16, int64_t stride, int64_t begin, int64_t end,
                   int8_t* values, float* scales, float* corrections, int64_t cols) {
    const int64_t blocks = cols / kBlock, stored_blocks = padded_blocks(cols);
    float block[kBlock];
    for (int64_t row = begin; row < end; ++row) {
        for (int64_t b = blocks; b < stored_blocks; ++b) {
            scales[row * stored_blocks + b] = 0.0f;
            corrections[row * stored_blocks + b] = 0.0f;
        }
        for (int64_t b = 0; b < blocks; ++b) {
            const int64_t first = row * stride + b * kBlock;
            if (bfloat16) {
                const uint16_t* bits = static_cast<const uint16_t*>(source) + first;
                for (int i = 0; i < kBlock; ++i) block[i] = bfloat16_to_float(bits[i]);
            } else {
                std::memcpy(block, static_cast<const float*>(source) + first, sizeof block);
            }
            float largest = 0.0f;
            bool finite = true;
            for (int i = 0; i < kBlock; ++i) {
                largest = std::max(largest, std::fabs(block[i]));
                finite &= std::isfinite(block[i]);
            }
            int8_t* out = values + row * cols + b * kBlock;
            float scale;
            int32_t sum = 0;
            if (!finite) {
                // std::max drops a NaN and the clamp would turn it into -127: a block holding NaN or
                // inf gets a NaN scale instead, so every output of its row is NaN and a model that
                // blew up says so rather than yielding plausible numbers.
                scale = std::numeric_limits<float>::quiet_NaN();
                std::memset(out, 0, kBlock);
            } else {
                scale = largest / 127.0f;
                // A subnormal scale's inverse can overflow to inf, and 0 * inf would turn the block's
                // zeros into -127: a block that small quantizes to zeros, so every scale is 0 or normal.
                if (scale < std::numeric_limits<float>::min()) scale = 0.0f;
                const float inverse = scale != 0.0f ? 1.0f / scale : 0.0f;
                for (int i = 0; i < kBlock; ++i) {
                    float rounded = std::min(127.0f, std::max(-127.0f, round_half_even(block[i] * inverse)));
                    out[i] = static_cast<int8_t>(rounded);
                    sum += out[i];
                }
            }
            scales[row * stored_blocks + b] = scale;
            corrections[row * stored_blocks + b] = static_cast<float>(8 * sum);
        }
    }
}

void matmul_reference(const QuantizedRows& x, const Weights& w, const float* bias, Output out,
                      int64_t begin, int64_t end) {
    const int64_t blocks = w.inputs / kBlock, stored_blocks = padded_blocks(w.inputs);
    for (int64_t row = 0; row < x.rows; ++row) {
        const int8_t* activations = x.values + row * x.cols;
        const float* activation_scales = x.scales + row * stored_blocks;
        for (int64_t column = begin; column < end; ++column) {
            float lanes[8] = {0, 0, 0, 0, 0, 0, 0, 0};
            float corrections[8] = {0, 0, 0, 0, 0, 0, 0, 0};
            for (int64_t b = 0; b < blocks; ++b) {
                int32_t weights[kBlock];
                if (w.format == kInt8Rows) {
                    const int8_t* unit = reinterpret_cast<const int8_t*>(weight_unit(w, column, b));
                    for (int i = 0; i < kBlock; ++i) weights[i] = unit[i];
                } else {
                    for (int i = 0; i < kBlock; ++i) weights[i] = int4_nibble(w, column, b, i);
                }
                for (int lane = 0; lane < 8; ++lane) {
                    int32_t sum = 0;
                    for (int i = 4 * lane; i < 4 * lane + 4; ++i) sum += weights[i] * activations[b * kBlock + i];
                    if (w.format == kInt8Rows) {
                        lanes[lane] = std::fma(static_cast<float>(sum), activation_scales[b], lanes[lane]);
                    } else {
                        const float group_scale = float16_to_float(static_cast<const uint16_t*>(w.scales)[column * stored_blocks + b]);
                        lanes[lane] = std::fma(static_cast<float>(sum), group_scale * activation_scales[b], lanes[lane]);
                    }
                }
                if (w.format == kInt4Groups) {
                    const float group_scale = float16_to_float(static_cast<const uint16_t*>(w.scales)[column * stored_blocks + b]);
                    corrections[b % 8] = std::fma(group_scale * activation_scales[b], x.corrections[row * stored_blocks + b],
                                                  corrections[b % 8]);
                }
            }
            float value = sum_lanes(lanes);
            if (w.format == kInt8Rows) {
                value *= static_cast<const float*>(w.scales)[column];
            } else {
                value -= sum_lanes(corrections);
            }
            if (bias != nullptr) value += bias[column];
            store_output(out, row, column, value);
        }
    }
}

}  // namespace corechat

#include "lanes_scalar.h"
#define CORECHAT_ATTEND attend_reference
#include "attention.inc"
