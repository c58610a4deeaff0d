// The plain C++ reference every instruction-set path must match bit for bit, and the activation
// rounding of the reference and AVX2 paths (the AVX-512 paths round with avx512_vnni.cpp's, the same
// bits). Plain C++: built for this CPU's best instruction set, which vectorizes
// it, its bits are the same (no -ffast-math, -ffp-contract=off).
#include <algorithm>
#include <cmath>
#include <cstring>

#include "kernels.h"

namespace corechat {

namespace {

// Weight (output, block * kBlock + input) as stored, its offset included.
inline int32_t stored_weight(const Weights& w, int64_t output, int64_t block, int64_t input) {
    const uint8_t* data = tile_block(w, output / kTileOutputs, block);
    const int64_t row = output % kTileOutputs, group = input / kGroupInputs, k = input % kGroupInputs;
    if (w.format == kInt8Groups) return data[group * kGroupBytes + row * kGroupInputs + k];
    const int64_t load = group % 4, byte = row * kGroupInputs + k;
    const uint8_t packed = data[load * kGroupBytes + byte];
    const int32_t nibble = group < 4 ? (packed & 0x0f) : (packed >> 4);
    if (!top_bits(w.format)) return nibble;
    const uint8_t top = data[4 * kGroupBytes + (load / 2) * kGroupBytes + byte];
    const int shift = 4 * (load % 2) + (group < 4 ? 0 : 2);
    return nibble | (((top >> shift) & 0x3) << 4);
}

// Eight floats as one value of GCC's vector extension: plain C++ that each build lowers to its own
// instruction set (two SSE halves on the baseline, one AVX register above), with IEEE sums lane by
// lane, so every build computes the same bits.
typedef float Lanes8 __attribute__((vector_size(32)));
typedef int32_t Picks8 __attribute__((vector_size(32)));
typedef uint32_t Words8 __attribute__((vector_size(32)));
typedef uint16_t Halves8 __attribute__((vector_size(16)));
typedef int8_t Bytes8 __attribute__((vector_size(8)));

// One butterfly stage inside a run of 8: each lane adds its partner (the lane `partner` picks) to
// itself or, where `sign` is -1, to its own negation: a + b in a pair's first lane (as b + a, the same
// sum), a - b in its second. The product by +-1 is exact, so each lane's sum has the plain loop's bits.
inline Lanes8 stage(Lanes8 v, Picks8 partner, Lanes8 sign) { return __builtin_shuffle(v, partner) + v * sign; }

// The unnormalized fast Walsh-Hadamard transform of a block (four runs of 8), in place: at each
// stride h = 1, 2, 4, 8, 16 in turn, every pair (i, i + h) of each run of 2h becomes (a + b, a - b).
// Sylvester's ordering, so H is symmetric and quantized.py's rotate_groups, which rotates the
// weights, is the same matrix. Strides 1, 2, 4 pair lanes within a run, 8 and 16 pair runs; each
// sum is the one the plain loop would add, so its bits too.
inline void rotate_block(Lanes8* runs) {
    static_assert(kBlock == 32, "the butterfly is written for blocks of 32");
    for (int r = 0; r < 4; ++r) {
        Lanes8 v = runs[r];
        v = stage(v, Picks8{1, 0, 3, 2, 5, 4, 7, 6}, Lanes8{1, -1, 1, -1, 1, -1, 1, -1});
        v = stage(v, Picks8{2, 3, 0, 1, 6, 7, 4, 5}, Lanes8{1, 1, -1, -1, 1, 1, -1, -1});
        v = stage(v, Picks8{4, 5, 6, 7, 0, 1, 2, 3}, Lanes8{1, 1, 1, 1, -1, -1, -1, -1});
        runs[r] = v;
    }
    const Lanes8 a0 = runs[0] + runs[1], a1 = runs[0] - runs[1], a2 = runs[2] + runs[3], a3 = runs[2] - runs[3];
    runs[0] = a0 + a2;
    runs[1] = a1 + a3;
    runs[2] = a0 - a2;
    runs[3] = a1 - a3;
}

}  // namespace

// Each block in four runs of 8 lanes, every step lane by lane so the build's vector registers take
// it whole: the values widened from bfloat16 (bits << 16), rotated, the largest magnitude as the
// largest of their bits with the sign cleared (the order of the floats' for finite values; inf and
// NaN are the bits from 0x7f800000 up), then each value times the inverse step, rounded half to
// even by adding and subtracting 1.5 * 2^23 (exact for |value| < 2^22), clamped to -127..127.
void quantize_rows(const void* source, bool bfloat16, bool rotated, int64_t stride, int64_t begin, int64_t end,
                   int8_t* values, float* scales, int32_t* sums, int64_t cols) {
    constexpr float kMagic = 12582912.0f;
    const int64_t blocks = cols / kBlock;
    Lanes8 runs[4];
    for (int64_t row = begin; row < end; ++row) {
        for (int64_t b = 0; b < blocks; ++b) {
            const int64_t first = row * stride + b * kBlock;
            if (bfloat16) {
                const uint16_t* bits = static_cast<const uint16_t*>(source) + first;
                for (int r = 0; r < 4; ++r) {
                    Halves8 halves;
                    std::memcpy(&halves, bits + 8 * r, sizeof halves);
                    runs[r] = reinterpret_cast<Lanes8>(__builtin_convertvector(halves, Words8) << 16);
                }
            } else {
                std::memcpy(runs, static_cast<const float*>(source) + first, sizeof runs);
            }
            if (rotated) rotate_block(runs);
            Words8 largest_bits = {};
            for (int r = 0; r < 4; ++r) {
                const Words8 magnitude = reinterpret_cast<Words8>(runs[r]) & 0x7fffffffu;
                largest_bits = largest_bits > magnitude ? largest_bits : magnitude;
            }
            uint32_t top = 0;
            for (int i = 0; i < 8; ++i) top = std::max(top, static_cast<uint32_t>(largest_bits[i]));
            int8_t* out = values + row * cols + b * kBlock;
            float scale, inverse;
            int32_t sum = 0;
            if (!block_scale(top, rotated, scale, inverse)) {
                std::memset(out, 0, kBlock);
            } else {
                Picks8 total = {};
                for (int r = 0; r < 4; ++r) {
                    Lanes8 level = (runs[r] * inverse + kMagic) - kMagic;
                    level = level < -127.0f ? -127.0f : level;
                    level = level > 127.0f ? 127.0f : level;
                    const Picks8 whole = __builtin_convertvector(level, Picks8);
                    total += whole;
                    const Bytes8 bytes = __builtin_convertvector(whole, Bytes8);
                    std::memcpy(out + 8 * r, &bytes, sizeof bytes);
                }
                for (int i = 0; i < 8; ++i) sum += total[i];
            }
            scales[row * blocks + b] = scale;
            sums[row * blocks + b] = sum;
        }
    }
}

void matmul_reference(const QuantizedRows& x, const Weights& w, const float* bias, Output out,
                      int64_t begin, int64_t end) {
    const int64_t blocks = w.inputs / kBlock;
    const int32_t offset = weight_offset(w.format);
    for (int64_t row = 0; row < x.rows; ++row) {
        const int8_t* activations = x.values + row * x.cols;
        for (int64_t column = begin * kTileOutputs; column < std::min(end * kTileOutputs, w.outputs); ++column) {
            float acc = 0.0f;
            for (int64_t b = 0; b < blocks; ++b) {
                int32_t sum = -offset * x.sums[row * blocks + b];
                for (int64_t i = 0; i < kBlock; ++i) sum += stored_weight(w, column, b, i) * activations[b * kBlock + i];
                const float activation_scale = x.scales[row * blocks + b];
                const uint16_t* scales = tile_scales(w, column / kTileOutputs, b);
                const float group_scale = float16_to_float(scales[column % kTileOutputs]);
                acc = std::fma(static_cast<float>(sum), group_scale * activation_scale, acc);
                if (group_minimums(w.format))
                    acc = std::fma(float16_to_float(scales[kTileOutputs + column % kTileOutputs]),
                                   activation_scale * static_cast<float>(x.sums[row * blocks + b]), acc);
            }
            if (bias != nullptr) acc += bias[column];
            store_output(out, row, column, acc);
        }
    }
}

}  // namespace corechat

#include "lanes_scalar.h"
#define CORECHAT_ATTEND attend_reference
#define CORECHAT_ATTEND_PART attend_part_reference
#include "attention.inc"
#define CORECHAT_TOKEN_WEIGHTS token_weights_reference
#include "weights.inc"
