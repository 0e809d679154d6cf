/* Test-only: csrc/mse_pnorm.c built with its scalar branch (machines without AVX2);
   tests/estimators/test_mse_compat.py runs it against the torch path too. */
#undef __AVX512F__
#undef __AVX2__
#include "mse_pnorm.c"
