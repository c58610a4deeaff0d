// corechat's quantized products and decode attention: what every instruction-set path shares.
//
// Every path computes each output with the same arithmetic in the same order, whatever the number
// of rows, the tile shapes or the threads, so a row's result never depends on the rest of its batch
// and every path gives the reference's bits exactly:
//   - activations are rounded to int8 in blocks of 32 (one float scale s_x each, round half to
//     even); int4 products also take n = float(8 * sum of the block's int8 values); a block
//     holding NaN or inf has s_x = NaN (its values 0), which makes every output of its row NaN;
//     a block whose s_x = largest magnitude / 127 would be below FLT_MIN has s_x = 0 (values 0);
//   - within a block, lane j (0..7) of an 8-lane accumulator takes the exact integer sum over
//     elements 4j..4j+3 of stored weight times activation, blocks in order:
//       int8 rows:   acc[j] = fma(float(sum), s_x, acc[j])
//       int4 groups: acc[j] = fma(float(sum), s_w * s_x, acc[j]) with the stored nibbles (0..15,
//                    the weight plus 8) and the group's scale s_w; the +8 is taken back by
//                    corr[b % 8] = fma(s_w * s_x, n, corr[b % 8]) over the blocks b;
//   - lanes are summed as sum_lanes below; int8 rows: sum(acc) * row scale; int4 groups:
//     sum(acc) - sum(corr); then plus the bias, rounded to the output type.
// Per-block scales (activations' and int4 weights') are stored padded with zeros to a multiple
// of 8 blocks per row (padded_blocks), so SIMD code reads them 8 at a time without a tail.
//
// The helpers defined here are compiled into source files built for different instruction sets
// (reference.cpp for any x86-64, avx2.cpp, avx512_vnni.cpp, attention.cpp for the best). They live
// in an unnamed namespace, so each file keeps its own copy: as plain `inline` functions they would
// be one function to the linker, which would keep one file's copy (an AVX-512 one, say) for all of
// them, the reference's included.
#pragma once

#include <cstdint>
#include <cstring>
#include <limits>

namespace corechat {

constexpr int64_t kBlock = 32;  // activation block and int4 weight group, in elements
static_assert(kBlock == 8 * 4, "a block is 8 lanes of 4 elements");

enum WeightFormat : int { kInt8Rows = 0, kInt4Groups = 1 };

namespace {

constexpr int64_t padded_blocks(int64_t cols) { return (cols / kBlock + 7) / 8 * 8; }
static_assert(padded_blocks(kBlock) == 8 && padded_blocks(8 * kBlock) == 8 && padded_blocks(9 * kBlock) == 16,
              "scales are stored 8 blocks at a time");

}  // namespace

// Activations rounded to int8 per block: the values, one scale per block and the int4 n.
struct QuantizedRows {
    const int8_t* values;       // [rows, cols], -127..127
    const float* scales;        // [rows, padded_blocks(cols)]
    const float* corrections;   // [rows, padded_blocks(cols)], n above
    int64_t rows;
    int64_t cols;
};

// A weight matrix of `outputs` rows of `inputs` elements, as stored in the converted file. Each
// row is cut into 32-byte units: kInt8Rows, one block of 32 int8 weights (-127..127);
// kInt4Groups, a pair of groups of 32, byte i holding element i of the first group in its low
// nibble and of the second in its high nibble, as weight + 8 (-8..7 stored as 0..15), so one
// load, a shift and two masks give both groups (inputs a multiple of 64). Rows are interleaved
// by kInterleave: unit u of rows 4g..4g+3 lie side by side, so a tile of 4 rows reads one
// sequential stream; rows are padded with zeros to a multiple of kInterleave.
//   scales: kInt8Rows float32 [padded rows] (one per row); kInt4Groups float16 bits
//           [padded rows, padded_blocks(inputs)] (one per group).
constexpr int64_t kInterleave = 4;
constexpr int64_t kUnitBytes = 32;
static_assert(kUnitBytes == kBlock, "a unit is one block of int8 weights, or two groups' int4 nibbles");

struct Weights {
    int format;
    const void* data;
    const void* scales;
    int64_t outputs;  // the real rows (the stored ones are padded)
    int64_t inputs;
};

namespace {

inline int64_t units_per_row(const Weights& w) { return w.format == kInt8Rows ? w.inputs / kBlock : w.inputs / (2 * kBlock); }

// The 32 bytes of unit `unit` of row `row`; the next unit of the row is kInterleave units on.
inline const uint8_t* weight_unit(const Weights& w, int64_t row, int64_t unit) {
    const int64_t index = ((row / kInterleave) * units_per_row(w) + unit) * kInterleave + row % kInterleave;
    return static_cast<const uint8_t*>(w.data) + index * kUnitBytes;
}

}  // namespace

// Where a product writes: rows x outputs, float32 or bfloat16, row stride `stride` elements.
struct Output {
    void* data;
    int64_t stride;
    bool bfloat16;
};

// Compute outputs [begin, end) of every row: out = x @ w.T (+ bias).
using MatmulKernel = void (*)(const QuantizedRows& x, const Weights& w, const float* bias, Output out,
                              int64_t begin, int64_t end);

void matmul_reference(const QuantizedRows&, const Weights&, const float*, Output, int64_t, int64_t);
void matmul_avx2(const QuantizedRows&, const Weights&, const float*, Output, int64_t, int64_t);
void matmul_avx512_vnni(const QuantizedRows&, const Weights&, const float*, Output, int64_t, int64_t);

// Round rows [begin, end) of `source` (float32 or bfloat16 bits, row stride `stride`) into x's
// arrays (scales and corrections padded as QuantizedRows says).
void quantize_rows(const void* source, bool bfloat16, int64_t stride, int64_t begin, int64_t end,
                   int8_t* values, float* scales, float* corrections, int64_t cols);

// Attention by query rows: row r attends to columns [starts[r], ends[r]) of cache row
// cache_rows[r], and nothing else, in one fixed order. A decode step is one row per sequence over
// its own span of the left-padded batch cache (the padding never enters its sums); a prompt pass
// is one row per token over the keys up to its own position; either way a token's output is
// the same bits. bfloat16 in and out, float32 inside.
struct AttentionTask {
    const uint16_t* query;       // [rows, heads, dim], strides below
    const uint16_t* keys;        // [cache rows, kv_heads, width, dim], strides below (a token's dim contiguous)
    const uint16_t* values;      // as keys, the same strides
    const int64_t* cache_rows;   // [rows]
    const int64_t* starts;       // [rows]
    const int64_t* ends;         // [rows]
    uint16_t* output;            // [rows, heads, dim], contiguous
    int64_t query_row_stride, query_head_stride;
    int64_t cache_row_stride, cache_head_stride;
    int64_t heads, kv_heads, dim;
    float scale;
};

// Attend for (row, kv head) pairs [begin, end), numbered row * kv_heads + kv_head.
void attend(const AttentionTask& task, int64_t begin, int64_t end);

static_assert(sizeof(float) == 4 && std::numeric_limits<float>::is_iec559,
              "the conversions below move IEEE binary32 bits");

namespace {

inline float bfloat16_to_float(uint16_t bits) {
    uint32_t widened = static_cast<uint32_t>(bits) << 16;
    float value;
    std::memcpy(&value, &widened, sizeof value);
    return value;
}

// Round to nearest even, as torch does (NaN stays NaN).
inline uint16_t float_to_bfloat16(float value) {
    uint32_t bits;
    std::memcpy(&bits, &value, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40);
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return static_cast<uint16_t>(bits >> 16);
}

// IEEE half to float, exactly (subnormals included), without F16C.
inline float float16_to_float(uint16_t half) {
    uint32_t sign = static_cast<uint32_t>(half & 0x8000u) << 16;
    uint32_t exponent = (half >> 10) & 0x1fu;
    uint32_t mantissa = half & 0x3ffu;
    uint32_t bits;
    if (exponent == 0x1fu) {
        bits = sign | 0x7f800000u | (mantissa << 13);
    } else if (exponent != 0) {
        bits = sign | ((exponent + 112u) << 23) | (mantissa << 13);
    } else if (mantissa == 0) {
        bits = sign;
    } else {
        int shift = 0;
        while (!(mantissa & 0x400u)) {
            mantissa <<= 1;
            ++shift;
        }
        bits = sign | ((113u - shift) << 23) | ((mantissa & 0x3ffu) << 13);
    }
    float value;
    std::memcpy(&value, &bits, sizeof value);
    return value;
}

inline float sum_lanes(const float lanes[8]) {
    return ((lanes[0] + lanes[4]) + (lanes[2] + lanes[6])) + ((lanes[1] + lanes[5]) + (lanes[3] + lanes[7]));
}

inline void store_output(Output out, int64_t row, int64_t column, float value) {
    if (out.bfloat16) {
        static_cast<uint16_t*>(out.data)[row * out.stride + column] = float_to_bfloat16(value);
    } else {
        static_cast<float*>(out.data)[row * out.stride + column] = value;
    }
}

}  // namespace

}  // namespace corechat
