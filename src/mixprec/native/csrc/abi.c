/* The library's ABI version: the Python side checks it before binding any kernel. 2: one dtype-code table
 * (dtypes.h) for every kernel; mixprec_fp32sum_rows used to take bf16 = 1, fp16 = 2. */
#include "common.h"

int mixprec_abi_version(void) { return 2; }
