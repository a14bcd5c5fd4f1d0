// Lets a small function be called from host code and, when compiled by nvcc,
// from device code: the routing-plan formulas are shared this way.
#pragma once

#if defined(__CUDACC__)
#define MEGAMOE_HD __host__ __device__ __forceinline__
#else
#define MEGAMOE_HD inline
#endif
