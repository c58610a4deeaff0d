// Attention by query rows (kernels.h: AttentionTask), each over its own span of keys in a fixed order.
//
// Written as plain lane-wise C++ (8-lane partial sums, a polynomial exp) with explicit fma and no
// reassociation, and, where the build targets AVX2 and FMA, the same operations in the same order
// as intrinsics for the loops the compiler leaves scalar: every build gives the same bits, and a
// row's result depends only on its own query and cache.
#if defined(__AVX2__) && defined(__FMA__)
#define CORECHAT_ATTENTION_AVX2 1
#include <immintrin.h>
#else
#define CORECHAT_ATTENTION_AVX2 0
#endif

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

// The score of one key: lanes d % 8 summed by fma in order of d, then as sum_lanes, times scale.
inline float score(const float* query, const float* key, int64_t dim, float scale) {
#if CORECHAT_ATTENTION_AVX2
    __m256 acc = _mm256_setzero_ps();
    for (int64_t d = 0; d < dim; d += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(query + d), _mm256_loadu_ps(key + d), acc);
    __m128 sums = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    sums = _mm_add_ps(sums, _mm_movehl_ps(sums, sums));
    return _mm_cvtss_f32(_mm_add_ss(sums, _mm_shuffle_ps(sums, sums, 1))) * scale;
#else
    float lanes[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int64_t d = 0; d < dim; d += 8)
        for (int lane = 0; lane < 8; ++lane) lanes[lane] = std::fma(query[d + lane], key[d + lane], lanes[lane]);
    return sum_lanes(lanes) * scale;
#endif
}

#if CORECHAT_ATTENTION_AVX2
// exp_nonpositive on 8 lanes: its operations, one by one.
inline __m256 exp_nonpositive8(__m256 x) {
    x = _mm256_max_ps(_mm256_set1_ps(-87.0f), x);  // as std::max(x, -87): a NaN stays NaN
    const __m256 magic = _mm256_set1_ps(12582912.0f);
    const __m256 whole = _mm256_sub_ps(_mm256_add_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)), magic), magic);
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
#endif

// Replace scores by e^(score - largest) and return their sum: lane j % 8 in order of j, then sum_lanes.
inline float exponentiate(float* scores, int64_t count, float largest) {
    float partial[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    int64_t j = 0;
#if CORECHAT_ATTENTION_AVX2
    __m256 sums = _mm256_setzero_ps();
    for (; j + 8 <= count; j += 8) {
        const __m256 weights = exp_nonpositive8(_mm256_sub_ps(_mm256_loadu_ps(scores + j), _mm256_set1_ps(largest)));
        _mm256_storeu_ps(scores + j, weights);
        sums = _mm256_add_ps(sums, weights);
    }
    _mm256_storeu_ps(partial, sums);
#endif
    for (; j < count; ++j) {
        scores[j] = exp_nonpositive(scores[j] - largest);
        partial[j % 8] += scores[j];
    }
    return sum_lanes(partial);
}

}  // namespace

void attend(const AttentionTask& task, int64_t begin, int64_t end) {
    const int64_t dim = task.dim;
    const int64_t group = task.heads / task.kv_heads;
    // A key/value head's whole group of query heads walks its keys together: each key and value is
    // read and widened once per group instead of once per query head. Each (head, key) pair still
    // runs the same operations in the same order as it would alone.
    std::vector<float> queries(group * dim), outputs(group * dim), widened(dim), scores, largest(group), totals(group);
    for (int64_t pair = begin; pair < end; ++pair) {
        const int64_t row = pair / task.kv_heads;
        const int64_t kv_head = pair % task.kv_heads;
        const int64_t start = task.starts[row];
        const int64_t count = task.ends[row] - start;
        const int64_t first = task.cache_rows[row] * task.cache_row_stride + kv_head * task.cache_head_stride + start * dim;
        const uint16_t* keys = task.keys + first;
        const uint16_t* values = task.values + first;
        scores.resize(group * count);
        for (int64_t h = 0; h < group; ++h) {
            const uint16_t* q = task.query + row * task.query_row_stride + (kv_head * group + h) * task.query_head_stride;
            for (int64_t d = 0; d < dim; ++d) queries[h * dim + d] = bfloat16_to_float(q[d]);
            largest[h] = -INFINITY;
        }
        for (int64_t j = 0; j < count; ++j) {
            const uint16_t* key = keys + j * dim;
            for (int64_t d = 0; d < dim; ++d) widened[d] = bfloat16_to_float(key[d]);
            for (int64_t h = 0; h < group; ++h) {
                const float value = score(queries.data() + h * dim, widened.data(), dim, task.scale);
                scores[h * count + j] = value;
                largest[h] = std::max(largest[h], value);
            }
        }
        for (int64_t h = 0; h < group; ++h) totals[h] = exponentiate(scores.data() + h * count, count, largest[h]);
        std::fill(outputs.begin(), outputs.end(), 0.0f);
        for (int64_t j = 0; j < count; ++j) {
            const uint16_t* value = values + j * dim;
            for (int64_t d = 0; d < dim; ++d) widened[d] = bfloat16_to_float(value[d]);
            for (int64_t h = 0; h < group; ++h) {
                const float weight = scores[h * count + j];
                float* output = outputs.data() + h * dim;
                for (int64_t d = 0; d < dim; ++d) output[d] = std::fma(weight, widened[d], output[d]);
            }
        }
        for (int64_t h = 0; h < group; ++h) {
            uint16_t* out = task.output + (row * task.heads + kv_head * group + h) * dim;
            for (int64_t d = 0; d < dim; ++d) out[d] = float_to_bfloat16(outputs[h * dim + d] / totals[h]);
        }
    }
}

}  // namespace corechat
