/* Test-only: csrc/mse_pnorm.c built with its AVX2 branch (on an AVX-512 machine the library
   itself takes the AVX-512 one); tests/estimators/test_mse_compat.py runs both. */
#undef __AVX512F__
#include "mse_pnorm.c"
