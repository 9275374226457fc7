/* fp16 (IEEE 754 binary16) and bfloat16 <-> float conversions, bit patterns in uint16_t. Plain C, header-only
 * (static inline), so the C core, the CUDA emulator's C++ and any tests share one definition. */
#ifndef HEXISEQ_HALF_H
#define HEXISEQ_HALF_H

#include <stdint.h>
#include <string.h>

/* Half-precision conversions used by the kernels; rounding is to nearest, ties to even.
 * NaN stays NaN (quiet), infinities and signed zeros are kept, f16 overflow gives infinity. */
static inline float hexiseq_bf16_to_f32(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint16_t hexiseq_f32_to_bf16(float f) {
    uint32_t x;
    memcpy(&x, &f, sizeof x);
    if ((x & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)((x >> 16) | 0x0040u); /* NaN: keep sign and top payload, force quiet */
    x += 0x7fffu + ((x >> 16) & 1u);           /* ties to even; carries into the exponent as needed */
    return (uint16_t)(x >> 16);
}

static inline float hexiseq_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu;
    uint32_t mant = h & 0x3ffu;
    uint32_t bits;
    if (exp == 0x1fu) {
        bits = sign | 0x7f800000u | (mant << 13); /* inf or NaN */
    } else if (exp != 0) {
        bits = sign | ((exp + 112u) << 23) | (mant << 13);
    } else {
        float f = (float)mant * 5.9604644775390625e-8f; /* subnormal: mant * 2^-24, exact */
        memcpy(&bits, &f, sizeof bits);
        bits |= sign;
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint16_t hexiseq_f32_to_f16(float f) {
    uint32_t x;
    memcpy(&x, &f, sizeof x);
    uint16_t sign = (uint16_t)((x >> 16) & 0x8000u);
    uint32_t ax = x & 0x7fffffffu;
    if (ax > 0x7f800000u)
        return (uint16_t)(sign | 0x7e00u | ((ax >> 13) & 0x3ffu)); /* NaN, quiet */
    if (ax >= 0x477ff000u)
        return (uint16_t)(sign | 0x7c00u); /* >= 65520 (or inf) rounds to inf */
    if (ax < 0x38800000u) {               /* below 2^-14: f16 subnormal or zero */
        if (ax < 0x33000000u)
            return sign; /* below 2^-25 (half the smallest subnormal): zero */
        uint32_t e = ax >> 23;
        uint32_t m = (ax & 0x7fffffu) | 0x800000u;
        uint32_t shift = 126u - e; /* value * 2^24 = m * 2^(e - 126) */
        uint32_t k = m >> shift;
        uint32_t rem = m & ((1u << shift) - 1u);
        uint32_t half = 1u << (shift - 1u);
        if (rem > half || (rem == half && (k & 1u)))
            k++;
        return (uint16_t)(sign | k);
    }
    uint32_t h = (((ax >> 23) - 112u) << 10) | ((ax >> 13) & 0x3ffu);
    uint32_t rem = ax & 0x1fffu;
    if (rem > 0x1000u || (rem == 0x1000u && (h & 1u)))
        h++; /* a mantissa carry moves into the exponent, still below 0x7c00 here */
    return (uint16_t)(sign | h);
}

#endif /* HEXISEQ_HALF_H */
