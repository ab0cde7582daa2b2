/* The library's ABI version: the Python side checks it before binding any kernel. */
#include "common.h"

int mixprec_abi_version(void) { return 1; }
