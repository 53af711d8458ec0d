// Part of the kernel source (see formats.cu): every type's block decoder, on the layouts of
// formats.cu and the tables of grids.cu.

// Decode staged slice s into 32 floats, with the float32 operations of ggml's reference
// dequantization in its order (the Python twins in quants.py repeat them).
template <int TYPE>
__device__ void decode_slice(const typename BlockFormat<TYPE>::Unit* units, int s, float* out);

template <> __device__ void decode_slice<ES_TYPE_Q4_0>(const unsigned short* units, int, float* out) {
    const float d = half_to_float(units[0]);
#pragma unroll
    for (int j = 0; j < 16; ++j) {
        const int q = (int)block_byte(units, 2 + j);
        out[j] = d * small_float(q & 0xf, 8);
        out[j + 16] = d * small_float(q >> 4, 8);
    }
}

template <> __device__ void decode_slice<ES_TYPE_Q4_1>(const unsigned short* units, int, float* out) {
    const float d = half_to_float(units[0]);
    const float m = half_to_float(units[1]);
#pragma unroll
    for (int j = 0; j < 16; ++j) {
        const int q = (int)block_byte(units, 4 + j);
        out[j] = fmaf(d, small_float(q & 0xf, 0), m);
        out[j + 16] = fmaf(d, small_float(q >> 4, 0), m);
    }
}

template <> __device__ void decode_slice<ES_TYPE_Q5_0>(const unsigned short* units, int, float* out) {
    const float d = half_to_float(units[0]);
    const unsigned int qh = units[1] | ((unsigned int)units[2] << 16);
#pragma unroll
    for (int j = 0; j < 16; ++j) {
        const int q = (int)block_byte(units, 6 + j);
        const int high_low = (int)((qh >> j) & 1u) << 4;
        const int high_high = (int)((qh >> (j + 16)) & 1u) << 4;
        out[j] = d * small_float((q & 0xf) | high_low, 16);
        out[j + 16] = d * small_float((q >> 4) | high_high, 16);
    }
}

template <> __device__ void decode_slice<ES_TYPE_Q5_1>(const unsigned short* units, int, float* out) {
    const float d = half_to_float(units[0]);
    const float m = half_to_float(units[1]);
    const unsigned int qh = units[2] | ((unsigned int)units[3] << 16);
#pragma unroll
    for (int j = 0; j < 16; ++j) {
        const int q = (int)block_byte(units, 8 + j);
        const int high_low = (int)((qh >> j) & 1u) << 4;
        const int high_high = (int)((qh >> (j + 16)) & 1u) << 4;
        out[j] = fmaf(d, small_float((q & 0xf) | high_low, 0), m);
        out[j + 16] = fmaf(d, small_float((q >> 4) | high_high, 0), m);
    }
}

template <> __device__ void decode_slice<ES_TYPE_Q8_0>(const unsigned short* units, int, float* out) {
    const float d = half_to_float(units[0]);
#pragma unroll
    for (int j = 0; j < 32; ++j) {
        const int q = (int)block_byte(units, 2 + j);
        out[j] = d * small_float(q ^ 0x80, 128);  // the signed byte
    }
}

template <> __device__ void decode_slice<ES_TYPE_IQ4_NL>(const unsigned short* units, int, float* out) {
    const float d = half_to_float(units[0]);
#pragma unroll
    for (int j = 0; j < 16; ++j) {
        const int q = (int)block_byte(units, 2 + j);
        out[j] = d * (float)IQ4_VALUES[q & 0xf];
        out[j + 16] = d * (float)IQ4_VALUES[q >> 4];
    }
}

// Half the E8M0 scale, 2^(e - 128); subnormal below e = 2, as ggml computes it.
__device__ float e8m0_half(unsigned int e) {
    return bits_to_float(e < 2 ? 0x00200000u << e : (e - 1) << 23);
}

template <> __device__ void decode_slice<ES_TYPE_MXFP4>(const unsigned char* units, int, float* out) {
    const float d = e8m0_half(units[0]);
#pragma unroll
    for (int j = 0; j < 16; ++j) {
        const int q = units[1 + j];
        out[j] = d * (float)MXFP4_VALUES[q & 0xf];
        out[j + 16] = d * (float)MXFP4_VALUES[q >> 4];
    }
}

template <> __device__ void decode_slice<ES_TYPE_F16>(const unsigned short* units, int, float* out) {
#pragma unroll
    for (int j = 0; j < 32; ++j) {
        out[j] = half_to_float(units[j]);
    }
}

template <> __device__ void decode_slice<ES_TYPE_BF16>(const unsigned short* units, int, float* out) {
#pragma unroll
    for (int j = 0; j < 32; ++j) {
        out[j] = bf16_to_float(units[j]);
    }
}

template <> __device__ void decode_slice<ES_TYPE_F32>(const unsigned int* units, int, float* out) {
#pragma unroll
    for (int j = 0; j < 32; ++j) {
        out[j] = bits_to_float(units[j]);
    }
}

template <> __device__ void decode_slice<ES_TYPE_Q2_K>(const unsigned short* units, int s, float* out) {
    const float d = half_to_float(units[17]);
    const float dmin = half_to_float(units[18]);
    const int shift = 2 * (s & 3);
#pragma unroll
    for (int part = 0; part < 2; ++part) {
        const int sc = (int)block_byte(units, part);
        const float dl = d * (float)(sc & 0xf);
        const float ml = dmin * (float)(sc >> 4);
#pragma unroll
        for (int l = 0; l < 16; ++l) {
            const int q = ((int)block_byte(units, 2 + 16 * part + l) >> shift) & 3;
            out[16 * part + l] = dl * small_float(q, 0) - ml;
        }
    }
}

// Scale i (0..15) of Q3_K from its 12 packed bytes: low 4 bits from byte i % 8 (nibble i / 8),
// high 2 bits from byte 8 + i % 4 (bits 2 * (i / 4)).
__device__ int q3_k_scale(const unsigned short* units, int packed_at, int i) {
    const int low = ((int)block_byte(units, packed_at + (i & 7)) >> (4 * (i >> 3))) & 0xf;
    const int high = ((int)block_byte(units, packed_at + 8 + (i & 3)) >> (2 * (i >> 2))) & 3;
    return (low | (high << 4)) - 32;
}

template <> __device__ void decode_slice<ES_TYPE_Q3_K>(const unsigned short* units, int s, float* out) {
    const float d = half_to_float(units[38]);
    const int shift = 2 * (s & 3);
#pragma unroll
    for (int part = 0; part < 2; ++part) {
        const float dl = d * (float)q3_k_scale(units, 64, 2 * s + part);
#pragma unroll
        for (int l = 0; l < 16; ++l) {
            const int e = 16 * part + l;
            const int low = ((int)block_byte(units, 32 + e) >> shift) & 3;
            const int high = ((int)block_byte(units, e) >> s) & 1;
            out[e] = dl * small_float(low | (high << 2), 4);  // low - (high ? 0 : 4)
        }
    }
}

// Scale and min j (0..7) of Q4_K / Q5_K from their 12 packed bytes at byte 4 (units 2..7),
// taken as three 32-bit words and shifted: a j known only at run time then indexes no array, so
// units held in registers stay there.
__device__ void k4_scale_min(const unsigned short* units, int j, int* sc, int* m) {
    const unsigned int w1 = units[2] | ((unsigned int)units[3] << 16);  // scales 0..3
    const unsigned int w2 = units[4] | ((unsigned int)units[5] << 16);  // scales 4..7
    const unsigned int w3 = units[6] | ((unsigned int)units[7] << 16);  // scales 8..11
    const int shift = 8 * (j & 3);
    const int a = (int)((w1 >> shift) & 0xffu);
    const int b = (int)((w2 >> shift) & 0xffu);
    const int c = (int)((w3 >> shift) & 0xffu);
    if (j < 4) {
        *sc = a & 63;
        *m = b & 63;
    } else {
        *sc = (c & 0xf) | ((a >> 6) << 4);
        *m = (c >> 4) | ((b >> 6) << 4);
    }
}

template <> __device__ void decode_slice<ES_TYPE_Q4_K>(const unsigned short* units, int s, float* out) {
    int sc;
    int m;
    k4_scale_min(units, s, &sc, &m);
    const float d = half_to_float(units[0]) * (float)sc;
    const float dm = half_to_float(units[1]) * (float)m;
    const int shift = 4 * (s & 1);
#pragma unroll
    for (int l = 0; l < 32; ++l) {
        const int q = ((int)block_byte(units, 16 + l) >> shift) & 0xf;
        out[l] = d * small_float(q, 0) - dm;
    }
}

template <> __device__ void decode_slice<ES_TYPE_Q5_K>(const unsigned short* units, int s, float* out) {
    int sc;
    int m;
    k4_scale_min(units, s, &sc, &m);
    const float d = half_to_float(units[0]) * (float)sc;
    const float dm = half_to_float(units[1]) * (float)m;
    const int shift = 4 * (s & 1);
#pragma unroll
    for (int l = 0; l < 32; ++l) {
        const int low = ((int)block_byte(units, 48 + l) >> shift) & 0xf;
        const int high = ((int)block_byte(units, 16 + l) >> s) & 1;
        out[l] = d * small_float(low | (high << 4), 0) - dm;
    }
}

template <> __device__ void decode_slice<ES_TYPE_Q6_K>(const unsigned short* units, int s, float* out) {
    const float d = half_to_float(units[33]);
    const int r = s & 3;
    const int low_shift = 4 * (r >> 1);
    const int high_shift = 2 * r;
#pragma unroll
    for (int part = 0; part < 2; ++part) {
        const int sc = (int)block_byte(units, 64 + part);
        const float dl = d * (float)(sc >= 128 ? sc - 256 : sc);
#pragma unroll
        for (int l = 0; l < 16; ++l) {
            const int e = 16 * part + l;
            const int low = ((int)block_byte(units, e) >> low_shift) & 0xf;
            const int high = ((int)block_byte(units, 32 + e) >> high_shift) & 3;
            out[e] = dl * small_float(low | (high << 4), 32);
        }
    }
}

template <> __device__ void decode_slice<ES_TYPE_IQ4_XS>(const unsigned short* units, int s, float* out) {
    const int low = ((int)block_byte(units, 4 + (s >> 1)) >> (4 * (s & 1))) & 0xf;
    const int high = (units[1] >> (2 * s)) & 3;
    const float dl = half_to_float(units[0]) * (float)((low | (high << 4)) - 32);
#pragma unroll
    for (int j = 0; j < 16; ++j) {
        const int q = (int)block_byte(units, 8 + j);
        out[j] = dl * (float)IQ4_VALUES[q & 0xf];
        out[j + 16] = dl * (float)IQ4_VALUES[q >> 4];
    }
}

// The 8 sign bits of a 7-bit sign index (IQ2_XXS, IQ2_XS, IQ3_XXS): bit 7 makes the
// number of negative signs even.
__device__ unsigned int iq_signs(unsigned int index) {
    unsigned int parity = index ^ (index >> 4);
    parity ^= parity >> 2;
    parity ^= parity >> 1;
    return index | ((parity & 1u) << 7);
}

__device__ float iq_sign(unsigned int signs, int j) {
    return (signs >> j) & 1u ? -1.0f : 1.0f;
}

// 8 elements of an IQ2 grid point: db * value * sign.
__device__ void iq2_point(unsigned int entry, unsigned int signs, float db, float* out) {
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        out[j] = db * (float)IQ2_GRID_VALUES[(entry >> (2 * j)) & 3u] * iq_sign(signs, j);
    }
}

// 8 elements of an IQ1 grid point: dl * (value + delta).
__device__ void iq1_point(unsigned int entry, float dl, float delta, float* out) {
#pragma unroll
    for (int j = 0; j < 8; ++j) {
        out[j] = dl * ((float)((int)((entry >> (2 * j)) & 3u) - 1) + delta);
    }
}

template <> __device__ void decode_slice<ES_TYPE_IQ1_S>(const unsigned short* units, int, float* out) {
    const unsigned int qh = units[3];
    const float dl = half_to_float(units[0]) * (float)(2 * ((qh >> 12) & 7u) + 1);
    const float delta = (qh & 0x8000u) ? -IQ1_DELTA : IQ1_DELTA;
#pragma unroll
    for (int l = 0; l < 4; ++l) {
        const unsigned int index = block_byte(units, 2 + l) | (((qh >> (3 * l)) & 7u) << 8);
        iq1_point(IQ1S_GRID[index], dl, delta, out + 8 * l);
    }
}

template <> __device__ void decode_slice<ES_TYPE_IQ1_M>(const unsigned short* units, int s, float* out) {
    const unsigned int d_bits =
        (units[3] >> 12) | ((units[4] >> 8) & 0x00f0u) | ((units[5] >> 4) & 0x0f00u) | (units[6] & 0xf000u);
    const float d = half_to_float(d_bits);
    const unsigned int sc = (unsigned int)units[3 + (s >> 1)] >> (6 * (s & 1));
    const float dl[2] = {d * (float)(2 * (sc & 7u) + 1), d * (float)(2 * ((sc >> 3) & 7u) + 1)};
#pragma unroll
    for (int l = 0; l < 4; ++l) {
        const unsigned int qh = block_byte(units, 4 + (l >> 1)) >> (4 * (l & 1));
        const unsigned int index = block_byte(units, l) | ((qh & 7u) << 8);
        iq1_point(IQ1S_GRID[index], dl[l >> 1], (qh & 8u) ? -IQ1_DELTA : IQ1_DELTA, out + 8 * l);
    }
}

template <> __device__ void decode_slice<ES_TYPE_IQ2_XXS>(const unsigned short* units, int, float* out) {
    const unsigned int aux = units[3] | ((unsigned int)units[4] << 16);
    const float db = half_to_float(units[0]) * (0.5f + (float)(aux >> 28)) * 0.25f;
#pragma unroll
    for (int l = 0; l < 4; ++l) {
        iq2_point(IQ2XXS_GRID[block_byte(units, 2 + l)], iq_signs((aux >> (7 * l)) & 127u), db, out + 8 * l);
    }
}

template <> __device__ void decode_slice<ES_TYPE_IQ2_XS>(const unsigned short* units, int s, float* out) {
    const float d = half_to_float(units[0]);
    const unsigned int sc = block_byte(units, 10 + (s & 1));
    const float db[2] = {d * (0.5f + (float)(sc & 0xfu)) * 0.25f, d * (0.5f + (float)(sc >> 4)) * 0.25f};
#pragma unroll
    for (int l = 0; l < 4; ++l) {
        const unsigned int q = units[1 + l];
        iq2_point(IQ2XS_GRID[q & 511u], iq_signs(q >> 9), db[l >> 1], out + 8 * l);
    }
}

template <> __device__ void decode_slice<ES_TYPE_IQ2_S>(const unsigned short* units, int s, float* out) {
    const float d = half_to_float(units[0]);
    const unsigned int qh = block_byte(units, 10 + (s & 1));
    const unsigned int sc = block_byte(units, 12 + (s & 1));
    const float db[2] = {d * (0.5f + (float)(sc & 0xfu)) * 0.25f, d * (0.5f + (float)(sc >> 4)) * 0.25f};
#pragma unroll
    for (int l = 0; l < 4; ++l) {
        const unsigned int index = block_byte(units, 2 + l) | (((qh >> (2 * l)) & 3u) << 8);
        iq2_point(IQ2S_GRID[index], block_byte(units, 6 + l), db[l >> 1], out + 8 * l);
    }
}

template <> __device__ void decode_slice<ES_TYPE_IQ3_XXS>(const unsigned short* units, int, float* out) {
    const unsigned int aux = units[5] | ((unsigned int)units[6] << 16);
    const float db = half_to_float(units[0]) * (0.5f + (float)(aux >> 28)) * 0.5f;
#pragma unroll
    for (int l = 0; l < 4; ++l) {
        const unsigned int signs = iq_signs((aux >> (7 * l)) & 127u);
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const unsigned int entry = IQ3XXS_GRID[block_byte(units, 2 + 2 * l + half)];
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const float value = (float)IQ3XXS_GRID_VALUES[(entry >> (4 * j)) & 7u];
                out[8 * l + 4 * half + j] = db * value * iq_sign(signs, 4 * half + j);
            }
        }
    }
}

template <> __device__ void decode_slice<ES_TYPE_IQ3_S>(const unsigned short* units, int s, float* out) {
    const unsigned int qh = block_byte(units, 10 + (s & 1));
    const unsigned int sc = (block_byte(units, 16 + ((s >> 1) & 1)) >> (4 * (s & 1))) & 0xfu;
    const float db = half_to_float(units[0]) * (float)(1 + 2 * sc);
#pragma unroll
    for (int l = 0; l < 4; ++l) {
        const unsigned int signs = block_byte(units, 12 + l);
#pragma unroll
        for (int half = 0; half < 2; ++half) {
            const int i = 2 * l + half;
            const unsigned int entry = IQ3S_GRID[block_byte(units, 2 + i) | (((qh >> i) & 1u) << 8)];
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const float value = (float)(2 * ((entry >> (4 * j)) & 7u) + 1);
                out[8 * l + 4 * half + j] = db * value * iq_sign(signs, 4 * half + j);
            }
        }
    }
}
