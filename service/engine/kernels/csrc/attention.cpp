// Attention by query rows (kernels.h: AttentionTask), each over its own span of keys in a fixed order.
//
// Written as plain lane-wise C++ (8-lane partial sums, a polynomial exp) with explicit fma and no
// reassociation, so the compiler may vectorize it for whatever instruction set it targets and
// every build still gives the same bits; a row's result depends only on its own query and cache.
#include <algorithm>
#include <cmath>
#include <vector>

#include "kernels.h"

namespace corechat {

namespace {

inline float round_half_even(float value) {
    constexpr float kMagic = 12582912.0f;
    return (value + kMagic) - kMagic;
}

// e^x for x <= 0 (scores minus their maximum), Cephes' expf polynomial: within 2 ulp.
inline float exp_nonpositive(float x) {
    x = std::max(x, -87.0f);
    const float whole = round_half_even(x * 1.44269504088896341f);
    x = x - whole * 0.693359375f;
    x = x - whole * -2.12194440e-4f;
    float y = 1.9875691500e-4f;
    y = std::fma(y, x, 1.3981999507e-3f);
    y = std::fma(y, x, 8.3334519073e-3f);
    y = std::fma(y, x, 4.1665795894e-2f);
    y = std::fma(y, x, 1.6666665459e-1f);
    y = std::fma(y, x, 5.0000001201e-1f);
    y = std::fma(y, x * x, x) + 1.0f;
    const uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(whole) + 127) << 23;
    float power;
    std::memcpy(&power, &bits, sizeof power);
    return y * power;
}

}  // namespace

void attend(const AttentionTask& task, int64_t begin, int64_t end) {
    const int64_t dim = task.dim;
    const int64_t group = task.heads / task.kv_heads;
    std::vector<float> query(dim), output(dim), scores;
    for (int64_t pair = begin; pair < end; ++pair) {
        const int64_t row = pair / task.kv_heads;
        const int64_t kv_head = pair % task.kv_heads;
        const int64_t start = task.starts[row];
        const int64_t count = task.ends[row] - start;
        const int64_t first = (task.cache_rows[row] * task.kv_heads + kv_head) * task.width + start;
        const uint16_t* keys = task.keys + first * dim;
        const uint16_t* values = task.values + first * dim;
        scores.resize(count);
        for (int64_t head = kv_head * group; head < (kv_head + 1) * group; ++head) {
            const uint16_t* q = task.query + row * task.query_row_stride + head * task.query_head_stride;
            for (int64_t d = 0; d < dim; ++d) query[d] = bfloat16_to_float(q[d]);
            float largest = -INFINITY;
            for (int64_t j = 0; j < count; ++j) {
                const uint16_t* key = keys + j * dim;
                float lanes[8] = {0, 0, 0, 0, 0, 0, 0, 0};
                for (int64_t d = 0; d < dim; d += 8)
                    for (int lane = 0; lane < 8; ++lane)
                        lanes[lane] = std::fma(query[d + lane], bfloat16_to_float(key[d + lane]), lanes[lane]);
                scores[j] = sum_lanes(lanes) * task.scale;
                largest = std::max(largest, scores[j]);
            }
            for (int64_t j = 0; j < count; ++j) scores[j] = exp_nonpositive(scores[j] - largest);
            float totals[8] = {0, 0, 0, 0, 0, 0, 0, 0};
            for (int64_t j = 0; j < count; ++j) totals[j % 8] += scores[j];
            const float total = sum_lanes(totals);
            std::fill(output.begin(), output.end(), 0.0f);
            for (int64_t j = 0; j < count; ++j) {
                const uint16_t* value = values + j * dim;
                const float weight = scores[j];
                for (int64_t d = 0; d < dim; ++d) output[d] = std::fma(weight, bfloat16_to_float(value[d]), output[d]);
            }
            uint16_t* out = task.output + (row * task.heads + head) * dim;
            for (int64_t d = 0; d < dim; ++d) out[d] = float_to_bfloat16(output[d] / total);
        }
    }
}

}  // namespace corechat
