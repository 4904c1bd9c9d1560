/* The sixteen signed int8 values a 4-bit IQ4 index stands for (IQ4_NL and IQ4_XS share them): a
 * non-linear grid, denser near zero where most weights are. */
static const int8_t IQ4_TABLE[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};
