// corechat's quantized products and paged attention: what every instruction-set path shares.
//
// Every path computes each output with the same arithmetic in the same order, whatever the number
// of rows, the tile shapes or the threads, so a row's result never depends on the rest of its batch
// and every path gives the reference's bits exactly:
//   - activations are rounded to int8 in blocks of 32 (one float scale s_x each, round half to
//     even) and each block's sum of its int8 values is kept; a block holding NaN or inf has s_x =
//     NaN (its values 0), which makes every output of its row NaN; a block whose s_x = largest
//     magnitude / 127 would be below FLT_MIN has s_x = 0 (values 0);
//   - for kInt8Groups and kInt6Groups, each activation block is first rotated by the 32 x 32 Hadamard matrix
//     (rotate_block), as the converter rotated each weight group: H is orthogonal, so the product
//     is unchanged, while an outlier's magnitude is spread over its whole block, which the rounding
//     then keeps finer. The butterfly's sums are sqrt(32) times the rotated values: s_x is rounded
//     from them and then carries the 1 / sqrt(32). A block whose sums overflow counts as non-finite;
//   - for each output, blocks in order, S = the exact integer sum over the block of weight times
//     activation, then acc = fma(float(S), s_w * s_x, acc) with the weights' scale s_w of that
//     row and block (float16, widened), the same for every format; kInt4Mins then adds its
//     group's minimum m_w (float16, widened): acc = fma(m_w, s_x * float(block's sum), acc);
//     then plus the bias, rounded to the output type.
// The weights are stored with an offset that makes them unsigned (int8 + 128, int6 + 32, int4 + 8;
// kInt4Mins' steps above the minimum are unsigned already), the operand vpdpbusd wants unsigned; S is the
// offset sum minus the offset times the block's sum of activations, which is exact and the same for
// every output (kernels read it as the starting value of their integer sums).
//
// The helpers defined here are compiled into source files built for different instruction sets
// (reference.cpp for any x86-64, avx2.cpp, avx512_vnni.cpp, amx.cpp). They live
// in an unnamed namespace, so each file keeps its own copy: as plain `inline` functions they would
// be one function to the linker, which would keep one file's copy (an AVX-512 one, say) for all of
// them, the reference's included.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

namespace corechat {

constexpr int64_t kBlock = 32;  // activation block and weight group, in elements

// kInt6Groups is no DTYPE of its own: the 4-bit DTYPEs store their output layer in it.
enum WeightFormat : int { kInt8Groups = 0, kInt4Groups = 1, kInt4Mins = 2, kInt6Groups = 3 };

constexpr bool known_format(int64_t format) { return format >= kInt8Groups && format <= kInt6Groups; }

// Whether a format stores its weights' low 4 bits as nibbles (kInt4Groups, kInt4Mins, kInt6Groups),
// whether it stores their top 2 bits after them (kInt6Groups), and whether it stores a minimum beside
// each group's scale.
constexpr bool packed_nibbles(int64_t format) { return format != kInt8Groups; }
constexpr bool top_bits(int64_t format) { return format == kInt6Groups; }
constexpr bool group_minimums(int64_t format) { return format == kInt4Mins; }

// Whether a format's weight groups are stored rotated, and its activation blocks rotated to match.
constexpr bool rotated_blocks(int64_t format) { return format == kInt8Groups || format == kInt6Groups; }

// Bits a format stores per weight, its scales aside.
constexpr int64_t weight_bits(int64_t format) { return format == kInt8Groups ? 8 : format == kInt6Groups ? 6 : 4; }

// Activations rounded to int8 per block: the values, one scale per block and the block's sum.
struct QuantizedRows {
    const int8_t* values;  // [rows, cols], -127..127
    const float* scales;   // [rows, cols / kBlock]
    const int32_t* sums;   // [rows, cols / kBlock]
    int64_t rows;
    int64_t cols;
};

// A weight matrix of `outputs` rows of `inputs` elements, as stored in the converted file: tiles of
// kTileOutputs rows (the last padded with zero weights), each tile's blocks in order, each block
// kTileOutputs x kBlock weights laid out so that one 64-byte load holds, for all 16 rows of the
// tile, four consecutive inputs each: the operands of one vpdpbusd.
//   kInt8Groups: a block is 8 such loads (inputs 4g..4g+3 of every row, g = 0..7), 512 bytes: byte
//     16 * 4 * g + 4 * row + k is weight (row, 4g + k) + 128.
//   kInt4Groups: a block is 4 loads, 256 bytes: byte 16 * 4 * p + 4 * row + k holds weight (row,
//     4p + k) + 8 in its low nibble and weight (row, 4(p + 4) + k) + 8 in its high nibble.
//   kInt4Mins: as kInt4Groups, each nibble the weight's steps above its group's minimum (0..15).
//   kInt6Groups: 384 bytes, kInt4Groups' 256 bytes of nibbles holding each weight + 32's low 4 bits,
//     then two 64-byte loads of top bits: bits 0-1, 2-3, 4-5, 6-7 of byte 64 * q + 4 * row + k
//     are the top 2 bits of the weight whose low nibble is that of byte 4 * row + k of nibble load
//     2q (low), 2q (high), 2q + 1 (low), 2q + 1 (high).
//   scales: float16 bits [tiles, blocks, kTileOutputs] (one per row per block of 32 inputs, a tile's
//     block's 16 side by side); for kInt4Mins [tiles, blocks, 2, kTileOutputs], the block's 16
//     scales and then its 16 minimums, so one 64-byte line holds both.
constexpr int64_t kTileOutputs = 16;
constexpr int64_t kGroupInputs = 4;
constexpr int64_t kGroupBytes = kTileOutputs * kGroupInputs;  // one vpdpbusd's weights
static_assert(kBlock % (2 * kGroupInputs) == 0 && kGroupBytes == 64, "a block is whole 64-byte loads");
constexpr int64_t kInt8Offset = 128;
constexpr int64_t kInt6Offset = 32;
constexpr int64_t kInt4Offset = 8;

// The offset a format's stored weights carry.
constexpr int32_t weight_offset(int64_t format) {
    return format == kInt8Groups ? kInt8Offset : format == kInt6Groups ? kInt6Offset : format == kInt4Groups ? kInt4Offset : 0;
}

struct Weights {
    int format;
    const uint8_t* data;
    const void* scales;
    int64_t outputs;  // the real rows (the stored ones are padded)
    int64_t inputs;
};

namespace {

constexpr int64_t padded_outputs(int64_t outputs) { return (outputs + kTileOutputs - 1) / kTileOutputs * kTileOutputs; }

// Bytes of one tile's block.
constexpr int64_t block_bytes(int format) { return kTileOutputs * kBlock * weight_bits(format) / 8; }

// Float16 values stored per tile block: the 16 scales, and for kInt4Mins the 16 minimums after them.
constexpr int64_t block_scales(int format) { return group_minimums(format) ? 2 * kTileOutputs : kTileOutputs; }

// The first byte of tile `tile`'s block `block`.
inline const uint8_t* tile_block(const Weights& w, int64_t tile, int64_t block) {
    return w.data + (tile * (w.inputs / kBlock) + block) * block_bytes(w.format);
}

// The float16 bits of a tile's block's 16 scales (kInt4Mins: followed by its 16 minimums).
inline const uint16_t* tile_scales(const Weights& w, int64_t tile, int64_t block) {
    return static_cast<const uint16_t*>(w.scales) + (tile * (w.inputs / kBlock) + block) * block_scales(w.format);
}

}  // namespace

// Where a product writes: rows x outputs, float32 or bfloat16, row stride `stride` elements.
struct Output {
    void* data;
    int64_t stride;
    bool bfloat16;
};

// Compute the outputs of tiles [begin, end) of every row: out = x @ w.T (+ bias); only the real
// outputs are written.
using MatmulKernel = void (*)(const QuantizedRows& x, const Weights& w, const float* bias, Output out,
                              int64_t begin, int64_t end);

void matmul_reference(const QuantizedRows&, const Weights&, const float*, Output, int64_t, int64_t);
void matmul_avx2(const QuantizedRows&, const Weights&, const float*, Output, int64_t, int64_t);
void matmul_avx512_vnni(const QuantizedRows&, const Weights&, const float*, Output, int64_t, int64_t);
void matmul_amx(const QuantizedRows&, const Weights&, const float*, Output, int64_t, int64_t);

// A rounded block's scale and the inverse of its step (largest / 127), from the bits of its largest
// magnitude (sign cleared): what every quantize_rows computes once per block. False for a block
// holding NaN or inf, which gets a NaN scale, so every output of its row is NaN and a model that
// blew up says so rather than yielding plausible numbers. A rotated block's scale carries the
// rotation's 1 / sqrt(32). A subnormal scale's inverse can overflow to inf, and 0 * inf would turn
// the block's zeros into -127: a block that small quantizes to zeros, so every scale is 0 or normal.
inline bool block_scale(uint32_t top, bool rotated, float& scale, float& inverse) {
    if (top >= 0x7f800000u) {
        scale = std::numeric_limits<float>::quiet_NaN();
        return false;
    }
    float largest;
    std::memcpy(&largest, &top, sizeof largest);
    const float steps = largest / 127.0f;
    scale = rotated ? steps * (1.0f / std::sqrt(static_cast<float>(kBlock))) : steps;
    if (scale < std::numeric_limits<float>::min()) scale = 0.0f;
    inverse = scale != 0.0f ? 1.0f / steps : 0.0f;
    return true;
}

// Round rows [begin, end) of `source` (float32 or bfloat16 bits, row stride `stride`) into x's
// arrays, each block rotated first if `rotated`.
void quantize_rows(const void* source, bool bfloat16, bool rotated, int64_t stride, int64_t begin, int64_t end,
                   int8_t* values, float* scales, int32_t* sums, int64_t cols);
// The same on AVX-512 registers (avx512_vnni.cpp), the same bits; ops.cpp's select_quantize picks a
// path's.
using QuantizeKernel = void (*)(const void* source, bool bfloat16, bool rotated, int64_t stride, int64_t begin,
                               int64_t end, int8_t* values, float* scales, int32_t* sums, int64_t cols);
void quantize_rows_avx512(const void* source, bool bfloat16, bool rotated, int64_t stride, int64_t begin, int64_t end,
                          int8_t* values, float* scales, int32_t* sums, int64_t cols);

// Paged attention: every running sequence's keys and values live in pages of one pool, a table
// per sequence listing its pages in order. The pool is [pages][layers][2][kv_heads][kPageTokens *
// dim] bfloat16: a layer's keys of a kv head hold elements d = 2i and 2i + 1 of the page's token t
// side by side at i * 2 * kPageTokens + 2t (the pairs of 16 tokens, which the score loop reads as
// one vector: a bfloat16 dot product's operand), its values element d of tokens 2u and 2u + 1 side
// by side at u * 2 * dim + 2d (which the value loop reads so, 16 elements at a time). A row (a query
// token) is written into its sequence's pages
// at its position, then attends to positions [0, position] in one fixed order (attention.inc).
constexpr int64_t kPageTokens = 64;
constexpr int64_t kKeyBlock = 16;
static_assert(kPageTokens % kKeyBlock == 0, "a key block never straddles two pages");

struct PagedAttention {
    const uint16_t* query;      // [rows, heads, dim], strides below, dim contiguous
    int64_t query_row_stride, query_head_stride;
    const uint16_t* pool;
    int64_t page_stride;        // elements from one page to the next
    int64_t keys_offset;        // elements from a page's start to this layer's keys, values
    int64_t values_offset;
    const int64_t* tables;      // [sequences, table_width] page numbers
    int64_t table_width;
    const int64_t* row_sequences;  // [rows] a row's table
    const int64_t* positions;   // [rows] a row's position in its sequence
    uint16_t* output;           // [rows, heads, dim], contiguous
    int64_t rows, heads, kv_heads, dim;
    float scale;
};

// The peak-rate probes: `iterations` rounds of a path's multiply-add instructions alone (avx512:
// kPeakLanesAvx512 x 64 multiply-adds a round, avx2: kPeakLanesAvx2 x 32, amx: kPeakAmx).
constexpr int kPeakLanesAvx512 = 12, kPeakLanesAvx2 = 5;
constexpr int64_t kPeakAmx = 4 * 16 * 16 * kBlock;
int64_t peak_loop_amx(int64_t iterations);
int64_t peak_loop_avx512(int64_t iterations);
int64_t peak_loop_avx2(int64_t iterations);

// Attend for (kv head, row) pairs [begin, end), numbered kv_head * rows + row; each path gives
// the reference's bits.
using AttendKernel = void (*)(const PagedAttention& task, int64_t begin, int64_t end);
void attend_reference(const PagedAttention&, int64_t, int64_t);
void attend_avx2(const PagedAttention&, int64_t, int64_t);
void attend_avx512(const PagedAttention&, int64_t, int64_t);
void attend_avx512_bf16(const PagedAttention&, int64_t, int64_t);

// One (kv head, row) pair's attention split `parts` ways, for long contexts with fewer pairs than
// threads (attention.inc: CORECHAT_ATTEND_PART): phase 0 scores part `part` of the pair's key
// blocks and keeps each query vector's largest score among them, phase 1 turns that part's scores
// into weights against the pair's largest, phase 2 weighs the values for part `part` of the dim's
// 16-lane slices; the caller runs a phase for every (pair, part) before the next. The pair's
// output is CORECHAT_ATTEND's bits: every score and weight is the same arithmetic, the total adds
// the weights in the same order, and each output lane's chain over the keys is the same chain.
struct AttendScratch {
    float* scores;     // [group, stride] the pair's scores, then its weights
    uint16_t* weight_bits;  // [group, stride] the weights' bfloat16 bits (where a path reads them so)
    int64_t stride;    // at least the pair's keys, a whole number of key blocks
    float* largest;    // [score_parts, group] each key part's largest score of each query vector
    int64_t score_parts;
};
using AttendPartKernel = void (*)(const PagedAttention& task, int phase, int64_t pair, int64_t part, int64_t parts,
                                  const AttendScratch& scratch);
void attend_part_reference(const PagedAttention&, int, int64_t, int64_t, int64_t, const AttendScratch&);
void attend_part_avx2(const PagedAttention&, int, int64_t, int64_t, int64_t, const AttendScratch&);
void attend_part_avx512(const PagedAttention&, int, int64_t, int64_t, int64_t, const AttendScratch&);
void attend_part_avx512_bf16(const PagedAttention&, int, int64_t, int64_t, int64_t, const AttendScratch&);

// The sampler's weights of a row of logits (weights.inc): each token's token_weight into `weights`,
// each block of kWeightBlock tokens' sum into `block_sums`; returns their total. Every path gives the
// reference's bits.
constexpr int64_t kWeightBlock = 1024;
using TokenWeightsKernel = double (*)(const float* row, int64_t width, float largest, float temperature, float* weights,
                                      double* block_sums);
double token_weights_reference(const float*, int64_t, float, float, float*, double*);
double token_weights_avx2(const float*, int64_t, float, float, float*, double*);
double token_weights_avx512(const float*, int64_t, float, float, float*, double*);

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

// The 16 lanes of attention.inc added in one fixed tree: lanes i and i + 8 first, then as sum_lanes.
inline float sum_sixteen(const float lanes[16]) {
    float halves[8];
    for (int i = 0; i < 8; ++i) halves[i] = lanes[i] + lanes[i + 8];
    return sum_lanes(halves);
}

// The largest of 16 lanes, compared in order as the SIMD max instructions compare (a NaN lane is
// taken when it comes second).
inline float largest_of_sixteen(const float lanes[16]) {
    float largest = lanes[0];
    for (int i = 1; i < 16; ++i) largest = largest > lanes[i] ? largest : lanes[i];
    return largest;
}

// log2(e) in float32: the sampler's exp and attention's 2^t both scale by it.
constexpr float kLog2E = 1.44269504088896341f;

// e^x for x <= 0 (the sampler's logits minus their maximum, over the temperature), Cephes' expf
// polynomial: within 2 ulp. Every path runs these operations in this order; a NaN stays NaN.
inline float exp_nonpositive_lane(float x) {
    constexpr float kMagic = 12582912.0f;  // adding and subtracting 1.5 * 2^23 rounds half to even
    x = -87.0f > x ? -87.0f : x;
    const float whole = (x * kLog2E + kMagic) - kMagic;
    x = x - whole * 0.693359375f;
    x = x - whole * -2.12194440e-4f;
    float y = 1.9875691500e-4f;
    y = std::fma(y, x, 1.3981999507e-3f);
    y = std::fma(y, x, 8.3334519073e-3f);
    y = std::fma(y, x, 4.1665795894e-2f);
    y = std::fma(y, x, 1.6666665459e-1f);
    y = std::fma(y, x, 5.0000001201e-1f);
    y = std::fma(y, x * x, x) + 1.0f;
    // What cvttps gives a NaN: INT32_MIN (the cast alone is undefined there), so the power is 1 and NaN stays NaN.
    const int32_t exponent = whole == whole ? static_cast<int32_t>(whole) : std::numeric_limits<int32_t>::min();
    const uint32_t bits = (static_cast<uint32_t>(exponent) + 127u) << 23;
    float power;
    std::memcpy(&power, &bits, sizeof power);
    return y * power;
}

// Attention's weights (attention.inc): 2^t for t <= 0 (a little above 0 where rounding puts the
// largest score's t), as 2^whole * p(t - whole), whole = t rounded to the nearest integer (half to
// even) and p a degree-4 polynomial for 2^f on [-0.5, 0.5] with a relative error under 2^-18: the
// weights are rounded to bfloat16 (a relative step of 2^-8) next, so exp_nonpositive_lane's 2^-23
// would be spent. t is clamped at -125, where the result is still normal (p >= 0.70); NaN stays NaN.
// One template over every path's lanes (`Lanes`: max, nearest, sub, fma, times_power_of_two; the
// scalar float for pow2_weight_lane), so every path computes these operations in this order.
constexpr float kPow2Floor = -125.0f;
constexpr float kPow2Coefficients[5] = {0.9999992847442627f, 0.6931217908859253f, 0.240247443318367f,
                                        0.05591786280274391f, 0.009570101276040077f};

// p * 2^whole for an integral `whole` in -125..0, by the power's bits; NaN `whole` (p is then NaN too) keeps p.
inline float times_power_of_two(float p, float whole) {
    if (whole != whole) return p;
    const uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(whole) + 127) << 23;
    float power;
    std::memcpy(&power, &bits, sizeof power);
    return p * power;
}

// The scalar lane's operations, for pow2_weight below.
struct ScalarLane {
    float v;
    static ScalarLane set1(float x) { return {x}; }
    static ScalarLane max(ScalarLane a, ScalarLane b) { return {a.v > b.v ? a.v : b.v}; }
    static ScalarLane nearest(ScalarLane x) { return {std::nearbyint(x.v)}; }
    static ScalarLane sub(ScalarLane a, ScalarLane b) { return {a.v - b.v}; }
    static ScalarLane fma(ScalarLane a, ScalarLane b, ScalarLane c) { return {std::fma(a.v, b.v, c.v)}; }
    static ScalarLane times_power_of_two(ScalarLane p, ScalarLane whole) { return {corechat::times_power_of_two(p.v, whole.v)}; }
};

template <typename L>
inline L pow2_weight(const L& t) {
    const L clamped = L::max(L::set1(kPow2Floor), t);
    const L whole = L::nearest(clamped);
    const L f = L::sub(clamped, whole);
    L p = L::set1(kPow2Coefficients[4]);
    for (int degree = 3; degree >= 0; --degree) p = L::fma(p, f, L::set1(kPow2Coefficients[degree]));
    return L::times_power_of_two(p, whole);
}

inline float pow2_weight_lane(float t) { return pow2_weight(ScalarLane{t}).v; }

// The sampler's weight of a token (weights.inc): e^x of x = (logit - largest) / temperature in float32,
// exp_nonpositive_lane's, and 0 below e^kWeightFloor (no token that far below the largest is drawn).
constexpr float kWeightFloor = -87.0f;
inline float token_weight(float logit, float largest, float temperature) {
    const float x = (logit - largest) / temperature;
    return x >= kWeightFloor ? exp_nonpositive_lane(x) : 0.0f;
}

}  // namespace

}  // namespace corechat
