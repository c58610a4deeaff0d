// The AMX path, for CPUs with AMX-INT8 besides AVX-512 VNNI: a product of 16 rows or more runs its
// integer sums on the tile unit, 16 rows by 16 outputs by one block of 32 inputs per tdpbssd, and
// the rest (a decode step's few rows, a prompt's last rows short of 16) as the AVX-512 VNNI path
// runs them. The float step per (output, row, block) is the VNNI path's, in the same order, on the
// same exact integer sums (kernels.h), so every row gets the same bits on either unit.
//
// Linux hands a process the tile registers only once it asks (arch_prctl ARCH_REQ_XCOMP_PERM):
// ops.cpp asks before it lists this path, and lists it only if granted.
#define CORECHAT_VNNI 1
#include "matmul_x86.inc"

#include <vector>

namespace corechat {

namespace {

// Rows per tile of activations: tdpbssd's most.
constexpr int64_t kAmxRows = 16;
// Rows whose activations stay in L2 while a thread's tiles of weights pass over them (128 x 4864
// bytes for Qwen2.5-0.5B's widest input).
constexpr int64_t kAmxRowChunk = 128;
// One tile's block of weights as tdpbssd reads it: kBlock / 4 rows of 64 bytes, four inputs of each
// of the 16 outputs, the stored layout (kernels.h: Weights) less the offset.
constexpr int64_t kSignedBlockBytes = kTileOutputs * kBlock;
static_assert(kGroupBytes == 64 && kBlock / kGroupInputs == 8, "a block of weights is one 8 x 64-byte tile");
// One row of a sum tile: 16 outputs' int32 sums.
constexpr int64_t kSumRowBytes = kTileOutputs * sizeof(int32_t);

// The tile registers' shapes (palette 1): tmm0, tmm1 two blocks' activations (16 rows x 32 int8);
// tmm2, tmm3 the two blocks' weights (8 x 64 int8); tmm4 to tmm7 sums (16 rows x 16 int32), two
// rounds' of two blocks.
struct alignas(64) TileConfig {
    uint8_t palette = 1;
    uint8_t start_row = 0;
    uint8_t reserved[14] = {};
    uint16_t bytes_per_row[16] = {kBlock, kBlock, kGroupBytes, kGroupBytes, kSumRowBytes, kSumRowBytes,
                                   kSumRowBytes, kSumRowBytes};
    uint8_t rows[16] = {kAmxRows, kAmxRows, kBlock / kGroupInputs, kBlock / kGroupInputs,
                        kAmxRows, kAmxRows, kAmxRows, kAmxRows};
};
static_assert(sizeof(TileConfig) == 64, "ldtilecfg reads 64 bytes");
constexpr TileConfig kTileConfig{};

// Tile `tile` of the weights as signed int8, block after block: int8 less its offset of 128 (its top
// bit flipped); int4 unpacked, each nibble less 8; int6 unpacked, less 32; int4 with minimums
// unpacked as it is (0..15).
template <int Format>
void signed_weights(const Weights& w, int64_t tile, int8_t* out) {
    const int64_t blocks = w.inputs / kBlock;
    for (int64_t b = 0; b < blocks; ++b) {
        const uint8_t* stored = tile_block(w, tile, b);
        int8_t* block = out + b * kSignedBlockBytes;
        if constexpr (Format == kInt8Groups) {
            const __m512i flip = _mm512_set1_epi8(static_cast<char>(0x80));
            for (int g = 0; g < kBlock / kGroupInputs; ++g)
                _mm512_storeu_si512(block + g * kGroupBytes, _mm512_xor_si512(_mm512_loadu_si512(stored + g * kGroupBytes), flip));
        } else {
            const __m512i nibbles = _mm512_set1_epi8(0x0f), offset = _mm512_set1_epi8(static_cast<char>(weight_offset(Format)));
            for (int p = 0; p < kBlock / kGroupInputs / 2; ++p) {
                const __m512i packed = _mm512_loadu_si512(stored + p * kGroupBytes);
                __m512i low = _mm512_and_si512(packed, nibbles), high = _mm512_and_si512(_mm512_srli_epi16(packed, 4), nibbles);
                if constexpr (top_bits(Format)) add_top_bits(stored, p, low, high);
                _mm512_storeu_si512(block + p * kGroupBytes, _mm512_sub_epi8(low, offset));
                _mm512_storeu_si512(block + (p + 4) * kGroupBytes, _mm512_sub_epi8(high, offset));
            }
        }
    }
}

// The float step of block `block` for rows [row, row + 16) of tile `tile`, from the tile unit's sums
// (16 rows of 16 int32): exactly tiles<>'s.
template <int Format>
inline void scale_block(const QuantizedRows& x, const Weights& w, int64_t tile, int64_t row, int64_t block,
                        const int32_t* sums, __m512 acc[kAmxRows]) {
    const int64_t blocks = w.inputs / kBlock;
    const float* scales = x.scales + row * blocks + block;
    const int32_t* activation_sums = x.sums + row * blocks + block;
    const uint16_t* stored = tile_scales(w, tile, block);
    const __m512 group_scales = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(stored)));
    for (int r = 0; r < kAmxRows; ++r) {
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_load_si512(sums + r * kTileOutputs)),
                                 _mm512_mul_ps(group_scales, _mm512_set1_ps(scales[r * blocks])), acc[r]);
        if constexpr (group_minimums(Format))
            acc[r] = _mm512_fmadd_ps(_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(stored + kTileOutputs))),
                                     _mm512_set1_ps(scales[r * blocks] * static_cast<float>(activation_sums[r * blocks])), acc[r]);
    }
}

// GCC's tile intrinsics take register numbers as literals (they paste them into the instruction).
// One block on the tile unit: activations into tmm `a`, weights into tmm `b`, their sums into `sum`.
#define CORECHAT_AMX_BLOCK(sum, a, b, block)                                   \
    do {                                                                       \
        _tile_loadd(a, values + (block) * kBlock, cols);                       \
        _tile_loadd(b, weights + (block) * kSignedBlockBytes, kGroupBytes);    \
        _tile_zero(sum);                                                       \
        _tile_dpbssd(sum, a, b);                                               \
    } while (0)

// Blocks `block` and `block` + 1 (if `two`) of rows [row, row + 16) into sum tiles tmm4 and tmm5
// (First 4) or tmm6 and tmm7 (First 6).
template <int First>
inline void issue_pair(const int8_t* values, int64_t cols, const int8_t* weights, int64_t block, bool two) {
    if constexpr (First == 4) {
        CORECHAT_AMX_BLOCK(4, 0, 2, block);
        if (two) CORECHAT_AMX_BLOCK(5, 1, 3, block + 1);
    } else {
        CORECHAT_AMX_BLOCK(6, 0, 2, block);
        if (two) CORECHAT_AMX_BLOCK(7, 1, 3, block + 1);
    }
}

// The pair of sum tiles issue_pair<First> filled (blocks `block` and `block` + 1) into the float
// sums, in block order.
template <int Format, int First>
inline void scale_pair(const QuantizedRows& x, const Weights& w, int64_t tile, int64_t row, int64_t block, bool two,
                       int32_t (*sums)[kAmxRows * kTileOutputs], __m512 acc[kAmxRows]) {
    if constexpr (First == 4) {
        _tile_stored(4, sums[0], kSumRowBytes);
        if (two) _tile_stored(5, sums[1], kSumRowBytes);
    } else {
        _tile_stored(6, sums[0], kSumRowBytes);
        if (two) _tile_stored(7, sums[1], kSumRowBytes);
    }
    scale_block<Format>(x, w, tile, row, block, sums[0], acc);
    if (two) scale_block<Format>(x, w, tile, row, block + 1, sums[1], acc);
}

// Tile `tile` for rows [row, row + 16), its weights already signed: two blocks per round on the
// tile unit, the next round's issued before this round's sums are scaled (sum tiles tmm4, tmm5 and
// tmm6, tmm7 in turns), each block's sums scaled in block order.
template <int Format>
void amx_tile(const QuantizedRows& x, const Weights& w, const float* bias, Output out, int64_t tile, int64_t row,
              const int8_t* weights) {
    const int64_t blocks = w.inputs / kBlock;
    const int8_t* values = x.values + row * x.cols;
    alignas(64) int32_t sums[2][kAmxRows * kTileOutputs];
    __m512 acc[kAmxRows];
    for (auto& lane : acc) lane = _mm512_setzero_ps();
    issue_pair<4>(values, x.cols, weights, 0, blocks > 1);
    for (int64_t b = 0; b < blocks; b += 4) {
        const bool two = b + 1 < blocks, next = b + 2 < blocks, next_two = b + 3 < blocks;
        if (next) issue_pair<6>(values, x.cols, weights, b + 2, next_two);
        scale_pair<Format, 4>(x, w, tile, row, b, two, sums, acc);
        if (!next) break;
        if (b + 4 < blocks) issue_pair<4>(values, x.cols, weights, b + 4, b + 5 < blocks);
        scale_pair<Format, 6>(x, w, tile, row, b + 2, next_two, sums, acc);
    }
    for (int r = 0; r < kAmxRows; ++r) finish_tile(w, bias, out, row + r, tile, acc[r]);
}

template <int Format>
void amx_matmul(const QuantizedRows& x, const Weights& w, const float* bias, Output out, int64_t begin, int64_t end) {
    const int64_t grouped = x.rows / kAmxRows * kAmxRows;
    if (grouped == 0) {
        matmul<Format>(x, w, bias, out, begin, end);
        return;
    }
    thread_local std::vector<int8_t> weights;
    weights.resize(static_cast<size_t>(w.inputs / kBlock * kSignedBlockBytes));
    _tile_loadconfig(&kTileConfig);
    for (int64_t chunk = 0; chunk < grouped; chunk += kAmxRowChunk) {
        const int64_t chunk_end = std::min(grouped, chunk + kAmxRowChunk);
        for (int64_t tile = begin; tile < end; ++tile) {
            signed_weights<Format>(w, tile, weights.data());
            for (int64_t row = chunk; row < chunk_end; row += kAmxRows)
                amx_tile<Format>(x, w, bias, out, tile, row, weights.data());
        }
    }
    _tile_release();
    sweep<Format, kManyRowsTiles, kManyRows>(x, w, bias, out, begin, end, grouped, x.rows - grouped);
}

}  // namespace

void matmul_amx(const QuantizedRows& x, const Weights& w, const float* bias, Output out, int64_t begin, int64_t end) {
    if (w.format == kInt8Groups) {
        amx_matmul<kInt8Groups>(x, w, bias, out, begin, end);
    } else if (w.format == kInt4Groups) {
        amx_matmul<kInt4Groups>(x, w, bias, out, begin, end);
    } else if (w.format == kInt6Groups) {
        amx_matmul<kInt6Groups>(x, w, bias, out, begin, end);
    } else {
        amx_matmul<kInt4Mins>(x, w, bias, out, begin, end);
    }
}

// The peak multiply-add rate's probe on the tile unit: tdpbssd of the product's shape (16 rows x 16
// outputs x 32 inputs) into four independent sums. Returns a sum so it is not elided.
int64_t peak_loop_amx(int64_t iterations) {
    alignas(64) int8_t ones[kAmxRows * kBlock];
    alignas(64) int32_t sums[kAmxRows * kTileOutputs];
    std::memset(ones, 1, sizeof ones);
    _tile_loadconfig(&kTileConfig);
    _tile_loadd(0, ones, kBlock);
    _tile_loadd(1, ones, kBlock);
    _tile_loadd(2, ones, kGroupBytes);
    _tile_loadd(3, ones, kGroupBytes);
    _tile_zero(4);
    _tile_zero(5);
    _tile_zero(6);
    _tile_zero(7);
    for (int64_t i = 0; i < iterations; ++i) {
        _tile_dpbssd(4, 0, 2);
        _tile_dpbssd(5, 1, 3);
        _tile_dpbssd(6, 0, 3);
        _tile_dpbssd(7, 1, 2);
    }
    int64_t total = 0;
    _tile_stored(4, sums, kSumRowBytes);
    total += sums[0];
    _tile_stored(7, sums, kSumRowBytes);
    total += sums[0];
    _tile_release();
    return total;
}

}  // namespace corechat
