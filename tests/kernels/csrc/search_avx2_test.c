/* Test-only: csrc/mse_search.c built with its AVX2 branch (on an AVX-512 machine the library
   itself takes the AVX-512 one); tests/kernels/test_price_nan.py runs each branch. */
#undef __AVX512F__
#include "mse_search.c"
