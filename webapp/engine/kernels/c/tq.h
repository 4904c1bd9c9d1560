#pragma once
#include <stdint.h>

enum { Q4_0 = 2, Q4_1 = 3, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14 };
/* Q4_0, Q4_1, Q8_0, Q4_K, Q5_K and Q6_K with eight rows' blocks side by side (see "interleaved rows" below): not GGUF
 * types, made from them at load by tq_repack */
enum { INTERLEAVED = 100, Q4_0x8 = INTERLEAVED + Q4_0, Q4_1x8 = INTERLEAVED + Q4_1, Q8_0x8 = INTERLEAVED + Q8_0, Q4_Kx8 = INTERLEAVED + Q4_K,
       Q5_Kx8 = INTERLEAVED + Q5_K,
       Q6_Kx8 = INTERLEAVED + Q6_K };
/* A matrix stacked by rows from parts of different types (a Q4_K_M layer's q and k in Q4_K over its v in
 * Q6_K), made at load by cpu.py: its bytes open with a stack_header (STACK_HEADER_BYTES), then each
 * part's blocks in turn, each in its own layout (interleaved or not). Products run a part at a time. */
enum { STACKED = 1000, MAX_PARTS = 7, STACK_HEADER_BYTES = 64 };
typedef struct {
  int32_t parts, types[MAX_PARTS], rows[MAX_PARTS], unused;
} stack_header;
_Static_assert(sizeof(stack_header) == STACK_HEADER_BYTES, "the header cpu.py writes");
