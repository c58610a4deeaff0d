// The x86 paths' scope of attention's dot product modes (attention.inc: Lanes::Flushing): the MXCSR's
// flush-to-zero and denormals-are-zero, which make their float32 FMAs vdpbf16ps's arithmetic, set for
// the scope's life and restored after. A write to the MXCSR costs hundreds of cycles: one scope
// serves many calls.
#pragma once

#include <immintrin.h>

namespace corechat {

struct MxcsrFlushing {
    unsigned int saved = _mm_getcsr();
    MxcsrFlushing() { _mm_setcsr(saved | _MM_FLUSH_ZERO_ON | _MM_DENORMALS_ZERO_ON); }
    ~MxcsrFlushing() { _mm_setcsr(saved); }
    MxcsrFlushing(const MxcsrFlushing&) = delete;
    MxcsrFlushing& operator=(const MxcsrFlushing&) = delete;
};

}  // namespace corechat
