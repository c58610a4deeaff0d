// The AVX2 product (maddubs + madd), for x86-64 CPUs with AVX2, FMA and F16C; 16 vector registers
// bound the tiles (outputs x rows) to about 8 accumulators.
#define CORECHAT_MATMUL matmul_avx2
#define CORECHAT_VNNI 0
#define CORECHAT_INT8_FEW_ROWS_OUTPUTS 4
#define CORECHAT_INT8_MANY_ROWS_OUTPUTS 2
#define CORECHAT_INT8_MANY_ROWS 4
#define CORECHAT_INT4_FEW_ROWS_OUTPUTS 4
#define CORECHAT_INT4_MANY_ROWS_OUTPUTS 2
#define CORECHAT_INT4_MANY_ROWS 4
#include "matmul_x86.inc"

#include "lanes_avx2.h"
#define CORECHAT_ATTEND attend_avx2
#include "attention.inc"
