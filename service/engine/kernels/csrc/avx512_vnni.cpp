// The AVX-512 VNNI product, for CPUs with AVX-512 F, BW, VL and VNNI: int8 tiles run vpdpbusd on
// 512-bit vectors, two outputs' 8-lane accumulators in each (tile_int8_pairs), int4 tiles on
// 256-bit ones; 32 vector registers allow larger tiles.
#define CORECHAT_MATMUL matmul_avx512_vnni
#define CORECHAT_VNNI 1
#define CORECHAT_INT8_FEW_ROWS_OUTPUTS 8
#define CORECHAT_INT8_MANY_ROWS_OUTPUTS 8
#define CORECHAT_INT8_MANY_ROWS 4
#define CORECHAT_INT4_FEW_ROWS_OUTPUTS 8
#define CORECHAT_INT4_MANY_ROWS_OUTPUTS 4
#define CORECHAT_INT4_MANY_ROWS 4
#include "matmul_x86.inc"

#include "lanes_avx512.h"
#define CORECHAT_ATTEND attend_avx512
#include "attention.inc"
