/* Test-only: csrc/mse_search.c built with its scalar branch (machines without AVX2);
   tests/kernels/test_price_nan.py runs each branch. */
#undef __AVX512F__
#undef __AVX2__
#include "mse_search.c"
