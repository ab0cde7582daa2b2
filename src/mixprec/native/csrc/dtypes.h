/* The element-type codes every kernel of the library takes: one table for the whole C boundary.
 *
 * mixprec/native/dtypes.py holds the same table on the Python side (DTYPE_CODES); tests/test_native_ops.py
 * parses this header and checks that the two agree. A kernel that reads fewer types refuses the others. */
#ifndef MIXPREC_DTYPES_H
#define MIXPREC_DTYPES_H
enum { MIXPREC_F32 = 0, MIXPREC_F16 = 1, MIXPREC_BF16 = 2, MIXPREC_F64 = 3 };
#endif
