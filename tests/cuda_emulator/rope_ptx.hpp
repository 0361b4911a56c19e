// The bf16/f16 conversions of src/cuda/rope_in_place.cu, emulated: included by the kernel in
// place of its inline PTX when POSENC_EMULATE names this file (POSENC_ROPE_DTYPE 1 or 2).

#pragma once

#include "emulate.hpp"

inline acc_t load(elem_t x) {
#if POSENC_ROPE_DTYPE == 1
  return emu::bf16_to_float(x);
#else
  return emu::f16_to_float(x);
#endif
}

inline elem_t store(acc_t x) {
#if POSENC_ROPE_DTYPE == 1
  return emu::float_to_bf16(x);
#else
  return emu::float_to_f16(x);
#endif
}
