/* tmx/tensor.h: element types and the tensor descriptor shared by the core and plugins.
 *
 * A tensor descriptor never owns its data: `data` points into an mmapped checkpoint, a buffer
 * the core allocated, or device memory a kernel set allocated. Whoever created the buffer frees
 * it. Shapes are row-major, outermost first, as in safetensors. */
#ifndef TMX_TENSOR_H
#define TMX_TENSOR_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define TMX_MAX_DIMS 4

enum tmx_dtype {
    TMX_DTYPE_F32 = 0,
    TMX_DTYPE_BF16,
    TMX_DTYPE_F16,
    TMX_DTYPE_F8_E4M3,
    TMX_DTYPE_U8,
    TMX_DTYPE_I32,
    TMX_DTYPE_I8,
    /* A weight format, not a file dtype (ABI 2.2): MXFP8 [m][k], k a multiple of 32, as one
     * buffer of m * k E4M3 codes followed by m * k / 32 UE8M0 scales; W[r][c] = e4m3(q[r][c]) *
     * 2^(scale[r][c / 32] - 127) (docs/trellismx.md, section 10.5). tmx_dtype_size gives the
     * codes' 1 byte; tmx_tensor_nbytes counts the scales too. */
    TMX_DTYPE_MXFP8,
    TMX_DTYPE_COUNT
};

struct tmx_tensor {
    enum tmx_dtype dtype;
    int ndim;
    int64_t shape[TMX_MAX_DIMS];
    void *data; /* host or device address; see the owner's header */
};

size_t tmx_dtype_size(enum tmx_dtype dt);
const char *tmx_dtype_name(enum tmx_dtype dt); /* safetensors spelling: "F32", "BF16", ... */
/* Returns TMX_DTYPE_COUNT when the name is not one tmx reads from a file (MXFP8 is not). */
enum tmx_dtype tmx_dtype_from_name(const char *name);

int64_t tmx_tensor_numel(const struct tmx_tensor *t);
size_t tmx_tensor_nbytes(const struct tmx_tensor *t);
/* The BF16 values of an MXFP8 tensor, out[numel] (exact for every E4M3 code times a scale
 * BF16 can hold: E4M3 has 3 mantissa bits, BF16 7). */
void tmx_mxfp8_to_bf16(const struct tmx_tensor *mx, uint16_t *out);

/* bf16 is the top half of an f32; rounding to nearest even, NaN kept quiet. */
static inline float tmx_bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t tmx_f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

static inline float tmx_f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, u;
    if (exp == 0x1f) {
        u = sign | 0x7f800000u | (man << 13);
    } else if (exp != 0) {
        u = sign | ((exp + 112) << 23) | (man << 13);
    } else if (man == 0) {
        u = sign;
    } else { /* subnormal: normalise */
        int e = -1;
        do { man <<= 1; e++; } while (!(man & 0x400u));
        u = sign | ((uint32_t)(112 - e) << 23) | ((man & 0x3ffu) << 13);
    }
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* OCP FP8 E4M3 ("fn"): bias 7, no infinities, S.1111.111 is NaN. */
static inline float tmx_e4m3_to_f32(uint8_t b) {
    uint32_t exp = (b >> 3) & 0xfu, man = b & 7u;
    float v;
    if (exp == 0xf && man == 7) {
        v = __builtin_nanf("");
    } else if (exp == 0) {
        v = (float)man * (1.0f / 512.0f); /* man/8 * 2^-6 */
    } else {
        v = (1.0f + (float)man / 8.0f) * (float)(1u << exp) / 128.0f;
    }
    return (b & 0x80u) ? -v : v;
}

/* f32 -> E4M3 (OCP FP8, bias 7, no infinities, 0x7f = NaN): round to nearest even, saturating
 * at +-448; NaN stays NaN. */
static inline uint8_t tmx_f32_to_e4m3(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    const uint8_t sign = (uint8_t)((u >> 24) & 0x80u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return sign | 0x7f;
    float a = f < 0 ? -f : f;
    if (!(a < 464.0f)) return sign | 0x7e; /* 448 is the largest finite; 464 rounds to it */
    if (a < 0.015625f) {                   /* subnormal: multiples of 2^-9 */
        float q = a * 512.0f;
        float r = (float)(int)q;
        float d = q - r;
        int m = (int)r + (d > 0.5f || (d == 0.5f && ((int)r & 1)));
        return sign | (uint8_t)m; /* m == 8 is the smallest normal, 0x08 */
    }
    memcpy(&u, &a, sizeof u);
    const uint32_t lsb = (u >> 20) & 1u;
    u += 0x7ffffu + lsb; /* round the 23-bit mantissa to 3 bits, ties to even */
    const int e = (int)(u >> 23) - 127 + 7;
    const uint8_t m = (uint8_t)((u >> 20) & 7u);
    if (e > 15 || (e == 15 && m == 7)) return sign | 0x7e;
    return sign | (uint8_t)(e << 3) | m;
}

#endif
