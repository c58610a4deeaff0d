// The AVX-512 path's attention with the bfloat16 dot product (AVX512_BF16: AMD Zen 4 and later,
// Intel Cooper Lake and Sapphire Rapids and later): a score's pair of products in one vdpbf16ps,
// 32 products an instruction where the FMAs of avx512_vnni.cpp's attention take 16. The same bits.
#define CORECHAT_BF16_DOT 1
#include "lanes_avx512.h"
#define CORECHAT_ATTEND attend_avx512_bf16
#define CORECHAT_ATTEND_PART attend_part_avx512_bf16
#include "attention.inc"
