// Mixture-of-Experts kernels: one source for NVRTC (CUDA) and hipRTC (HIP).
//
// Portability rules this file keeps:
// - no includes: f16 and bf16 are decoded from their bits by hand;
// - no warp-level intrinsics: every cooperation goes through shared memory and
//   __syncthreads, so the code is correct for any wavefront size (32 on NVIDIA,
//   64 on most AMD GPUs);
// - explicit fmaf, so both compilers accumulate with the same contraction.
//
// Weight layouts are ggml's (ggml-common.h): a 3-D expert tensor [n_expert][n_out][n_in]
// of rows of n_in elements, contiguous, each row a run of blocks. The matrix kernel steps
// k by 32 elements: one block of the 32-element types, one slice of the 256-element ones
// (K-quants, i-quants), which it decodes with the block's shared scales.

#define ES_TYPE_F32 0
#define ES_TYPE_F16 1
#define ES_TYPE_Q4_0 2
#define ES_TYPE_Q4_1 3
#define ES_TYPE_Q5_0 6
#define ES_TYPE_Q5_1 7
#define ES_TYPE_Q8_0 8
#define ES_TYPE_Q2_K 10
#define ES_TYPE_Q3_K 11
#define ES_TYPE_Q4_K 12
#define ES_TYPE_Q5_K 13
#define ES_TYPE_Q6_K 14
#define ES_TYPE_IQ2_XXS 16
#define ES_TYPE_IQ2_XS 17
#define ES_TYPE_IQ3_XXS 18
#define ES_TYPE_IQ1_S 19
#define ES_TYPE_IQ4_NL 20
#define ES_TYPE_IQ3_S 21
#define ES_TYPE_IQ2_S 22
#define ES_TYPE_IQ4_XS 23
#define ES_TYPE_IQ1_M 29
#define ES_TYPE_BF16 30
#define ES_TYPE_MXFP4 39

// Must match expertstream/kernels/layout.py.
#define MOE_MAX_EXPERTS 1024      // buckets in the grouping kernel (plus one for bad ids)
#define MOE_SCRATCH_HEADER 4      // ints before the tile table
#define MOE_TILE_N 128            // outputs per block in mul_mat_id
#define MOE_TILE_K 32             // elements per k step: one block or one 32-element slice
#define MOE_ROW_PADDING 512       // quantized rows are read in blocks of this many elements
#define MOE_MMID_THREADS 128
#define MOE_GROUP_THREADS 256
#define MOE_GROUP_CHUNK 2048      // pairs per grouping block
#define ROUTER_TOKENS 8           // tokens per block in router_topk
#define ROUTER_EXPERT_CHUNK 64    // experts per pass over n_embd
#define ROUTER_MAX_EXPERTS 512
#define ROUTER_MAX_K 32
#define ROUTER_THREADS 256        // ROUTER_TOKENS groups of 32 threads

struct alignas(16) vec4 {
    float x, y, z, w;
};

__device__ float bits_to_float(unsigned int bits) {
    union {
        unsigned int u;
        float f;
    } v;
    v.u = bits;
    return v.f;
}

// Exact for normals, subnormals, infinities and NaNs: the exponent is rebased by a
// multiplication with 2^112, which is exact for every finite half.
__device__ float half_to_float(unsigned int h) {
    unsigned int magnitude = (h & 0x7fffu) << 13;
    if ((h & 0x7c00u) == 0x7c00u) {
        magnitude |= 0x7f800000u;
    }
    float f = bits_to_float(magnitude) * bits_to_float(0x77800000u);
    return (h & 0x8000u) ? -f : f;
}

__device__ float bf16_to_float(unsigned int h) {
    return bits_to_float(h << 16);
}

// How each type is read. Per k step the kernel stages, for every row of the tile,
// `slice_units` units of `Unit` (16 bits for most types; bytes for MXFP4, whose 17-byte
// blocks break 16-bit alignment; 32-bit words for F32): unit h of slice s is unit
// unit_of(s, h) of the block. decode_slice turns the staged units of slice s into 32
// floats. `bytes` is the size of one block (of 32 elements for the float types).
template <int TYPE> struct BlockFormat;

// 32-element blocks: the slice is the whole block.
#define ES_WHOLE_BLOCK(TYPE, UNIT, BYTES)                                    \
    template <> struct BlockFormat<TYPE> {                                   \
        typedef UNIT Unit;                                                   \
        static const int bytes = BYTES;                                      \
        static const int slices = 1;                                         \
        static const int slice_units = BYTES / (int)sizeof(UNIT);            \
        static const bool quantized = TYPE != ES_TYPE_F32 && TYPE != ES_TYPE_F16 && TYPE != ES_TYPE_BF16; \
        __device__ static int unit_of(int, int h) { return h; }              \
    };

ES_WHOLE_BLOCK(ES_TYPE_Q4_0, unsigned short, 18)
ES_WHOLE_BLOCK(ES_TYPE_Q4_1, unsigned short, 20)
ES_WHOLE_BLOCK(ES_TYPE_Q5_0, unsigned short, 22)
ES_WHOLE_BLOCK(ES_TYPE_Q5_1, unsigned short, 24)
ES_WHOLE_BLOCK(ES_TYPE_Q8_0, unsigned short, 34)
ES_WHOLE_BLOCK(ES_TYPE_IQ4_NL, unsigned short, 18)
ES_WHOLE_BLOCK(ES_TYPE_MXFP4, unsigned char, 17)
ES_WHOLE_BLOCK(ES_TYPE_F16, unsigned short, 64)
ES_WHOLE_BLOCK(ES_TYPE_BF16, unsigned short, 64)
ES_WHOLE_BLOCK(ES_TYPE_F32, unsigned int, 128)

// 256-element blocks: slice s stages the block's scales and the quants of its 32 elements.
// Q2_K: scales[16] qs[64] d dmin. Slice s = 4 * half + j: the scale pair of bytes
// 8 * half + 2j, 2-bit quants j of the 32 bytes of its half, d and dmin.
template <> struct BlockFormat<ES_TYPE_Q2_K> {
    typedef unsigned short Unit;
    static const int bytes = 84;
    static const int slices = 8;
    static const int slice_units = 19;
    static const bool quantized = true;
    __device__ static int unit_of(int s, int h) {
        return h == 0 ? 4 * (s >> 2) + (s & 3) : (h < 17 ? 8 + 16 * (s >> 2) + h - 1 : 40 + h - 17);
    }
};
// Q3_K: hmask[32] qs[64] scales[12] d. Slice s = 4 * half + j: all of hmask (bit s), the
// 32 quant bytes of its half, the scales and d.
template <> struct BlockFormat<ES_TYPE_Q3_K> {
    typedef unsigned short Unit;
    static const int bytes = 110;
    static const int slices = 8;
    static const int slice_units = 39;
    static const bool quantized = true;
    __device__ static int unit_of(int s, int h) {
        return h < 16 ? h : (h < 32 ? 16 + 16 * (s >> 2) + h - 16 : 48 + h - 32);
    }
};
// Q4_K: d dmin scales[12] qs[128]. Slice s: the header and the 32 bytes of group s / 2,
// whose low nibbles are slice 2g and high nibbles slice 2g + 1.
template <> struct BlockFormat<ES_TYPE_Q4_K> {
    typedef unsigned short Unit;
    static const int bytes = 144;
    static const int slices = 8;
    static const int slice_units = 24;
    static const bool quantized = true;
    __device__ static int unit_of(int s, int h) { return h < 8 ? h : 8 + 16 * (s >> 1) + h - 8; }
};
// Q5_K: d dmin scales[12] qh[32] qs[128]: as Q4_K, plus all of qh (bit s).
template <> struct BlockFormat<ES_TYPE_Q5_K> {
    typedef unsigned short Unit;
    static const int bytes = 176;
    static const int slices = 8;
    static const int slice_units = 40;
    static const bool quantized = true;
    __device__ static int unit_of(int s, int h) { return h < 24 ? h : 24 + 16 * (s >> 1) + h - 24; }
};
// Q6_K: ql[128] qh[64] scales[16] d. Slice s = 4 * half + r: 32 ql bytes (nibble r / 2 of
// part r % 2 of the half), the 32 qh bytes of the half (bits 2r..2r+1), a scale pair, d.
template <> struct BlockFormat<ES_TYPE_Q6_K> {
    typedef unsigned short Unit;
    static const int bytes = 210;
    static const int slices = 8;
    static const int slice_units = 34;
    static const bool quantized = true;
    __device__ static int unit_of(int s, int h) {
        const int half = s >> 2;
        const int r = s & 3;
        if (h < 16) {
            return 32 * half + 16 * (r & 1) + h;
        }
        if (h < 32) {
            return 64 + 16 * half + h - 16;
        }
        return h == 32 ? 96 + 4 * half + r : 104;
    }
};
// IQ4_XS: d scales_h scales_l[4] qs[128]. Slice s: the header and its 16 quant bytes.
template <> struct BlockFormat<ES_TYPE_IQ4_XS> {
    typedef unsigned short Unit;
    static const int bytes = 136;
    static const int slices = 8;
    static const int slice_units = 12;
    static const bool quantized = true;
    __device__ static int unit_of(int s, int h) { return h < 4 ? h : 4 + 8 * s + h - 4; }
};

// The i-quants IQ1_S .. IQ3_S: eight 32-element sub-blocks, each element a point of a
// lattice grid (the tables below), with signs and a scale per sub-block. Slice s stages
// the block's f16 scale and the grid indices, signs and scale bits of sub-block s.

// IQ1_S: d qs[32] qh[8 x 16 bits]. Slice s: d, its 4 index bytes, qh[s].
template <> struct BlockFormat<ES_TYPE_IQ1_S> {
    typedef unsigned short Unit;
    static const int bytes = 50;
    static const int slices = 8;
    static const int slice_units = 4;
    static const bool quantized = true;
    __device__ static int unit_of(int s, int h) { return h == 0 ? 0 : (h < 3 ? 2 * s + h : 17 + s); }
};

// IQ1_M: qs[32] qh[16] scales[4 x 16 bits], the f16 scale spread over the top nibbles of
// the four scale words. Slice s: its 4 index bytes, its 2 qh bytes, all four scale words.
template <> struct BlockFormat<ES_TYPE_IQ1_M> {
    typedef unsigned short Unit;
    static const int bytes = 56;
    static const int slices = 8;
    static const int slice_units = 7;
    static const bool quantized = true;
    __device__ static int unit_of(int s, int h) { return h < 2 ? 2 * s + h : (h == 2 ? 16 + s : 24 + h - 3); }
};

// IQ2_XXS: d qs[64]; sub-block s is 4 index bytes then a 32-bit word of four 7-bit sign
// indices and a 4-bit scale. Slice s: d and those 8 bytes.
template <> struct BlockFormat<ES_TYPE_IQ2_XXS> {
    typedef unsigned short Unit;
    static const int bytes = 66;
    static const int slices = 8;
    static const int slice_units = 5;
    static const bool quantized = true;
    __device__ static int unit_of(int s, int h) { return h == 0 ? 0 : 4 * s + h; }
};

// IQ2_XS: d qs[32 x 16 bits: 9-bit index, 7-bit sign index] scales[8]. Slice s: d, its
// four index words, the scale pair in byte s.
template <> struct BlockFormat<ES_TYPE_IQ2_XS> {
    typedef unsigned short Unit;
    static const int bytes = 74;
    static const int slices = 8;
    static const int slice_units = 6;
    static const bool quantized = true;
    __device__ static int unit_of(int s, int h) { return h == 0 ? 0 : (h < 5 ? 4 * s + h : 33 + (s >> 1)); }
};

// IQ2_S: d qs[32] signs[32] qh[8] scales[8]. Slice s: d, its 4 index bytes, its 4 sign
// bytes, qh[s] (2 high index bits each) and the scale pair in scales[s].
template <> struct BlockFormat<ES_TYPE_IQ2_S> {
    typedef unsigned short Unit;
    static const int bytes = 82;
    static const int slices = 8;
    static const int slice_units = 7;
    static const bool quantized = true;
    __device__ static int unit_of(int s, int h) {
        if (h < 3) {
            return h == 0 ? 0 : 2 * s + h;
        }
        return h < 5 ? 17 + 2 * s + h - 3 : (h == 5 ? 33 + (s >> 1) : 37 + (s >> 1));
    }
};

// IQ3_XXS: d qs[64] scales_signs[8 x 32 bits]. Slice s: d, its 8 index bytes, its word of
// four 7-bit sign indices and a 4-bit scale.
template <> struct BlockFormat<ES_TYPE_IQ3_XXS> {
    typedef unsigned short Unit;
    static const int bytes = 98;
    static const int slices = 8;
    static const int slice_units = 7;
    static const bool quantized = true;
    __device__ static int unit_of(int s, int h) { return h == 0 ? 0 : (h < 5 ? 4 * s + h : 33 + 2 * s + h - 5); }
};

// IQ3_S: d qs[64] qh[8] signs[32] scales[4]. Slice s: d, its 8 index bytes, qh[s] (the
// 9th index bits), its 4 sign bytes and the scale nibble s of scales.
template <> struct BlockFormat<ES_TYPE_IQ3_S> {
    typedef unsigned short Unit;
    static const int bytes = 110;
    static const int slices = 8;
    static const int slice_units = 9;
    static const bool quantized = true;
    __device__ static int unit_of(int s, int h) {
        if (h < 5) {
            return h == 0 ? 0 : 4 * s + h;
        }
        return h == 5 ? 33 + (s >> 1) : (h < 8 ? 37 + 2 * s + h - 6 : 53 + (s >> 2));
    }
};

__device__ unsigned int block_byte(const unsigned short* units, int i) {
    return (units[i >> 1] >> ((i & 1) * 8)) & 0xffu;
}

__device__ unsigned int block_byte(const unsigned char* units, int i) {
    return units[i];
}

__device__ const signed char IQ4_VALUES[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                               1,    13,   25,  38,  53,  69,  89,  113};
__device__ const signed char MXFP4_VALUES[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

// The i-quant lattice grids, one 16-bit entry per grid point: element j of the point is
// code (entry >> (2 * j)) & 3 for the 8-element grids (IQ1_S/IQ1_M codes -1, 0, 1 as
// 0, 1, 2; IQ2 codes index IQ2_GRID_VALUES) and nibble j for the 4-element IQ3 grids
// (IQ3_XXS: IQ3XXS_GRID_VALUES; IQ3_S: 2 * code + 1). They are ggml's iq*_grid tables
// with each value replaced by its code, as gguf-py stores them.
__device__ const unsigned char IQ2_GRID_VALUES[3] = {0x08, 0x19, 0x2b};
__device__ const unsigned char IQ3XXS_GRID_VALUES[8] = {0x04, 0x0c, 0x14, 0x1c, 0x24, 0x2c, 0x34, 0x3e};
#define IQ1_DELTA 0.125f

__device__ const unsigned short IQ1S_GRID[2048] = {
    0x0000, 0x0002, 0x0005, 0x0008, 0x000a, 0x0011, 0x0015, 0x0020, 0x0022, 0x0028, 0x002a, 0x0045,
    0x0051, 0x0054, 0x0056, 0x0065, 0x0080, 0x0082, 0x0088, 0x008a, 0x0095, 0x00a0, 0x00a2, 0x00a8,
    0x00aa, 0x0104, 0x0105, 0x0111, 0x0114, 0x0116, 0x0119, 0x011a, 0x0125, 0x0141, 0x0146, 0x0149,
    0x0152, 0x0155, 0x015a, 0x0161, 0x0164, 0x0166, 0x0168, 0x0185, 0x0191, 0x0194, 0x0196, 0x01a5,
    0x0200, 0x0202, 0x0208, 0x020a, 0x0215, 0x0220, 0x0222, 0x0228, 0x022a, 0x0245, 0x0251, 0x0259,
    0x0264, 0x0269, 0x0280, 0x0282, 0x0288, 0x028a, 0x0291, 0x0295, 0x0299, 0x02a0, 0x02a2, 0x02a8,
    0x02aa, 0x0411, 0x0414, 0x0416, 0x0425, 0x0441, 0x0449, 0x0455, 0x045a, 0x0464, 0x0465, 0x0491,
    0x0499, 0x04a5, 0x0501, 0x0504, 0x0505, 0x0506, 0x0515, 0x0518, 0x051a, 0x0529, 0x0540, 0x0545,
    0x054a, 0x0550, 0x0551, 0x0554, 0x0555, 0x0556, 0x0559, 0x0560, 0x0562, 0x0565, 0x0568, 0x056a,
    0x0581, 0x0591, 0x0595, 0x0598, 0x059a, 0x05a1, 0x05a4, 0x05a5, 0x05a6, 0x05a9, 0x0614, 0x0619,
    0x0641, 0x0644, 0x0650, 0x0652, 0x0655, 0x0658, 0x0660, 0x0661, 0x0666, 0x0669, 0x0685, 0x0691,
    0x0694, 0x0699, 0x0800, 0x0802, 0x0808, 0x080a, 0x0815, 0x0820, 0x0822, 0x0828, 0x082a, 0x0845,
    0x0851, 0x0856, 0x0865, 0x0880, 0x0882, 0x0888, 0x088a, 0x0895, 0x08a0, 0x08a2, 0x08a8, 0x08aa,
    0x0905, 0x0911, 0x0914, 0x0919, 0x0924, 0x0925, 0x0941, 0x0950, 0x0951, 0x0955, 0x0961, 0x0964,
    0x0969, 0x0991, 0x0994, 0x0996, 0x0999, 0x09a5, 0x0a00, 0x0a02, 0x0a08, 0x0a0a, 0x0a15, 0x0a20,
    0x0a22, 0x0a28, 0x0a2a, 0x0a45, 0x0a51, 0x0a59, 0x0a61, 0x0a65, 0x0a80, 0x0a82, 0x0a85, 0x0a88,
    0x0a8a, 0x0a95, 0x0aa0, 0x0aa2, 0x0aa8, 0x0aaa, 0x1010, 0x1011, 0x1014, 0x1019, 0x1024, 0x1025,
    0x1041, 0x1044, 0x1050, 0x1055, 0x1058, 0x1061, 0x1064, 0x1065, 0x1069, 0x1091, 0x1094, 0x1096,
    0x10a1, 0x10a5, 0x1101, 0x1104, 0x1106, 0x1109, 0x1110, 0x1112, 0x1115, 0x1118, 0x1121, 0x1124,
    0x1129, 0x1145, 0x114a, 0x1150, 0x1151, 0x1152, 0x1154, 0x1155, 0x1156, 0x1159, 0x1160, 0x1165,
    0x1184, 0x1192, 0x1195, 0x11a1, 0x11a4, 0x1211, 0x1214, 0x1216, 0x1225, 0x1240, 0x1246, 0x1249,
    0x1252, 0x1255, 0x1258, 0x125a, 0x1264, 0x1266, 0x1285, 0x1291, 0x1294, 0x1296, 0x12a5, 0x1401,
    0x1406, 0x1409, 0x1414, 0x1415, 0x1418, 0x1419, 0x1421, 0x1426, 0x1441, 0x1445, 0x1446, 0x1448,
    0x144a, 0x1451, 0x1454, 0x1455, 0x1456, 0x1459, 0x1462, 0x1465, 0x1468, 0x1484, 0x1489, 0x1490,
    0x1494, 0x1495, 0x1498, 0x1499, 0x149a, 0x14a1, 0x14a4, 0x14a5, 0x14a9, 0x1502, 0x1505, 0x150a,
    0x1511, 0x1514, 0x1515, 0x1516, 0x1519, 0x1520, 0x1522, 0x1525, 0x1528, 0x152a, 0x1541, 0x1544,
    0x1545, 0x1546, 0x1551, 0x1552, 0x1554, 0x1555, 0x1556, 0x1559, 0x155a, 0x1561, 0x1564, 0x1565,
    0x1566, 0x1569, 0x1580, 0x1582, 0x1584, 0x1585, 0x1588, 0x158a, 0x1590, 0x1591, 0x1594, 0x1595,
    0x1596, 0x1599, 0x159a, 0x15a0, 0x15a2, 0x15a5, 0x1601, 0x1604, 0x1605, 0x1606, 0x1615, 0x1616,
    0x1618, 0x161a, 0x1621, 0x1626, 0x1640, 0x1642, 0x1644, 0x1645, 0x1648, 0x164a, 0x1651, 0x1655,
    0x1656, 0x1658, 0x1659, 0x1661, 0x1664, 0x1665, 0x1668, 0x1669, 0x166a, 0x1686, 0x168a, 0x1692,
    0x1695, 0x16a4, 0x16a9, 0x1811, 0x1816, 0x1825, 0x1841, 0x1844, 0x1846, 0x1849, 0x1850, 0x1855,
    0x1858, 0x185a, 0x1860, 0x1861, 0x1864, 0x1866, 0x1869, 0x1885, 0x1891, 0x1894, 0x18a5, 0x1910,
    0x1912, 0x1915, 0x191a, 0x1921, 0x1925, 0x1942, 0x1944, 0x1945, 0x1948, 0x1951, 0x1954, 0x1955,
    0x1956, 0x1959, 0x195a, 0x1960, 0x1965, 0x196a, 0x1989, 0x1991, 0x1992, 0x1995, 0x1998, 0x19a1,
    0x19a6, 0x19a9, 0x1a09, 0x1a16, 0x1a24, 0x1a26, 0x1a44, 0x1a46, 0x1a49, 0x1a50, 0x1a52, 0x1a55,
    0x1a58, 0x1a61, 0x1a66, 0x1a69, 0x1a85, 0x1a91, 0x1a96, 0x1a9a, 0x2000, 0x2002, 0x2008, 0x200a,
    0x2015, 0x2020, 0x2022, 0x2025, 0x2028, 0x202a, 0x2045, 0x2051, 0x2059, 0x2061, 0x2065, 0x2080,
    0x2082, 0x2088, 0x208a, 0x2095, 0x20a0, 0x20a2, 0x20a5, 0x20a8, 0x20aa, 0x2105, 0x2111, 0x2114,
    0x2119, 0x2125, 0x2142, 0x2144, 0x2149, 0x2155, 0x2158, 0x215a, 0x2161, 0x2164, 0x2165, 0x2166,
    0x2185, 0x2190, 0x2196, 0x2199, 0x21a5, 0x2201, 0x2208, 0x220a, 0x2211, 0x2215, 0x2220, 0x2222,
    0x2228, 0x222a, 0x2245, 0x2251, 0x2256, 0x2259, 0x2265, 0x2281, 0x2288, 0x228a, 0x2291, 0x2295,
    0x22a0, 0x22a2, 0x22a8, 0x22aa, 0x2405, 0x2414, 0x2416, 0x2419, 0x2425, 0x2444, 0x2445, 0x2446,
    0x2449, 0x2452, 0x2455, 0x2458, 0x245a, 0x2466, 0x2485, 0x2491, 0x2494, 0x2499, 0x24a1, 0x24a5,
    0x2509, 0x2515, 0x2521, 0x2529, 0x2540, 0x2545, 0x2548, 0x2551, 0x2554, 0x2555, 0x2559, 0x2562,
    0x2565, 0x2568, 0x2589, 0x2590, 0x2594, 0x2595, 0x2598, 0x259a, 0x25a1, 0x25a4, 0x25a6, 0x25a9,
    0x2605, 0x2610, 0x2612, 0x2619, 0x2625, 0x2641, 0x2649, 0x2655, 0x2660, 0x2661, 0x2669, 0x2684,
    0x2686, 0x2690, 0x269a, 0x2800, 0x2802, 0x2808, 0x280a, 0x2815, 0x2820, 0x2822, 0x2828, 0x282a,
    0x2845, 0x2851, 0x2854, 0x2865, 0x2880, 0x2882, 0x2888, 0x288a, 0x28a0, 0x28a2, 0x28a8, 0x28aa,
    0x2909, 0x2911, 0x2914, 0x2919, 0x2925, 0x2946, 0x2949, 0x2952, 0x2955, 0x2961, 0x2964, 0x2966,
    0x2969, 0x2985, 0x2990, 0x2996, 0x2999, 0x29a4, 0x29a5, 0x2a00, 0x2a02, 0x2a08, 0x2a0a, 0x2a20,
    0x2a22, 0x2a28, 0x2a2a, 0x2a45, 0x2a51, 0x2a56, 0x2a59, 0x2a65, 0x2a80, 0x2a82, 0x2a88, 0x2a8a,
    0x2a95, 0x2aa0, 0x2aa2, 0x2aa8, 0x2aaa, 0x4005, 0x4011, 0x4016, 0x4025, 0x4049, 0x4052, 0x4055,
    0x4058, 0x405a, 0x4061, 0x4064, 0x4066, 0x4094, 0x4099, 0x40a1, 0x40a6, 0x4100, 0x4101, 0x4104,
    0x4106, 0x4109, 0x4112, 0x4115, 0x4116, 0x4118, 0x411a, 0x4121, 0x4126, 0x4129, 0x4145, 0x4148,
    0x414a, 0x4151, 0x4154, 0x4155, 0x4156, 0x4159, 0x415a, 0x4165, 0x4168, 0x416a, 0x4181, 0x4184,
    0x4186, 0x4190, 0x4192, 0x4195, 0x41a0, 0x41a1, 0x41a2, 0x4205, 0x4211, 0x4214, 0x4216, 0x4225,
    0x4241, 0x4252, 0x4255, 0x425a, 0x4264, 0x4269, 0x4289, 0x4294, 0x42a5, 0x4401, 0x4415, 0x4419,
    0x4429, 0x4445, 0x4448, 0x444a, 0x4451, 0x4454, 0x4455, 0x4456, 0x4461, 0x4462, 0x4465, 0x4468,
    0x446a, 0x4481, 0x4486, 0x4489, 0x4490, 0x4492, 0x4495, 0x44a0, 0x44a1, 0x44a9, 0x4501, 0x4502,
    0x4505, 0x450a, 0x4511, 0x4514, 0x4515, 0x4516, 0x4519, 0x4520, 0x4525, 0x452a, 0x4541, 0x4544,
    0x4545, 0x4546, 0x4549, 0x4550, 0x4551, 0x4554, 0x4555, 0x4556, 0x4558, 0x4559, 0x4561, 0x4564,
    0x4565, 0x4566, 0x4569, 0x4582, 0x4584, 0x4585, 0x4588, 0x4591, 0x4594, 0x4595, 0x4596, 0x4599,
    0x459a, 0x45a5, 0x45a8, 0x45aa, 0x4601, 0x4605, 0x4609, 0x4614, 0x4615, 0x4618, 0x461a, 0x4621,
    0x4624, 0x4629, 0x4640, 0x4642, 0x4645, 0x4648, 0x4650, 0x4651, 0x4652, 0x4655, 0x4656, 0x4659,
    0x4662, 0x4665, 0x4668, 0x4681, 0x4685, 0x468a, 0x4694, 0x4695, 0x46a1, 0x46a4, 0x46a6, 0x4805,
    0x4811, 0x4815, 0x481a, 0x4825, 0x4842, 0x4849, 0x4850, 0x4855, 0x4858, 0x4861, 0x4864, 0x4866,
    0x4869, 0x4885, 0x4891, 0x4894, 0x4896, 0x4899, 0x48a5, 0x4901, 0x4905, 0x4906, 0x490a, 0x4910,
    0x4914, 0x4915, 0x4918, 0x4921, 0x4924, 0x4926, 0x4940, 0x4945, 0x494a, 0x4951, 0x4952, 0x4954,
    0x4955, 0x4956, 0x4959, 0x4960, 0x4962, 0x4965, 0x4966, 0x496a, 0x4986, 0x4989, 0x4992, 0x4995,
    0x4996, 0x4998, 0x49a1, 0x49a4, 0x49a6, 0x49a9, 0x4a16, 0x4a44, 0x4a46, 0x4a49, 0x4a55, 0x4a58,
    0x4a5a, 0x4a64, 0x4a69, 0x4a94, 0x4aa5, 0x5001, 0x5004, 0x5005, 0x5006, 0x5009, 0x5012, 0x5015,
    0x501a, 0x5021, 0x5024, 0x5029, 0x5040, 0x5045, 0x5048, 0x5051, 0x5054, 0x5055, 0x5056, 0x5059,
    0x5065, 0x5068, 0x5086, 0x5089, 0x5095, 0x5098, 0x50a0, 0x50a1, 0x50a6, 0x50a9, 0x5105, 0x5108,
    0x5109, 0x510a, 0x5111, 0x5114, 0x5115, 0x5116, 0x5118, 0x5119, 0x5120, 0x5125, 0x5126, 0x5128,
    0x512a, 0x5141, 0x5144, 0x5145, 0x5146, 0x5149, 0x5150, 0x5151, 0x5152, 0x5154, 0x5155, 0x5156,
    0x5158, 0x5159, 0x515a, 0x5161, 0x5164, 0x5165, 0x5166, 0x5169, 0x5182, 0x5185, 0x5191, 0x5194,
    0x5195, 0x5196, 0x5199, 0x51a0, 0x51a5, 0x51aa, 0x5201, 0x5206, 0x5212, 0x5215, 0x521a, 0x5221,
    0x5224, 0x5242, 0x5245, 0x524a, 0x5251, 0x5254, 0x5255, 0x5256, 0x5259, 0x5262, 0x5265, 0x5285,
    0x5290, 0x5292, 0x5295, 0x5299, 0x529a, 0x52a4, 0x5404, 0x5405, 0x5411, 0x5414, 0x5415, 0x5416,
    0x5418, 0x5419, 0x5421, 0x5425, 0x5428, 0x542a, 0x5441, 0x5444, 0x5445, 0x5446, 0x5449, 0x544a,
    0x5450, 0x5451, 0x5454, 0x5455, 0x5456, 0x5458, 0x5459, 0x545a, 0x5461, 0x5462, 0x5464, 0x5465,
    0x5466, 0x5469, 0x5480, 0x5488, 0x548a, 0x5491, 0x5494, 0x5495, 0x5496, 0x5499, 0x54a1, 0x54a4,
    0x54a5, 0x54aa, 0x5501, 0x5502, 0x5504, 0x5505, 0x5506, 0x5509, 0x5510, 0x5511, 0x5512, 0x5514,
    0x5515, 0x5516, 0x5519, 0x551a, 0x5521, 0x5524, 0x5525, 0x5526, 0x5529, 0x5540, 0x5541, 0x5542,
    0x5544, 0x5545, 0x5546, 0x5548, 0x5549, 0x5550, 0x5551, 0x5552, 0x5554, 0x5555, 0x5556, 0x5558,
    0x5559, 0x555a, 0x5560, 0x5561, 0x5564, 0x5565, 0x5566, 0x5568, 0x5569, 0x556a, 0x5581, 0x5584,
    0x5585, 0x5589, 0x558a, 0x5590, 0x5591, 0x5594, 0x5595, 0x5596, 0x5598, 0x5599, 0x55a1, 0x55a4,
    0x55a5, 0x55a6, 0x55a9, 0x5600, 0x5601, 0x5602, 0x5604, 0x5606, 0x5608, 0x5609, 0x5611, 0x5614,
    0x5615, 0x5618, 0x5619, 0x5620, 0x5621, 0x5622, 0x5624, 0x5625, 0x5626, 0x5628, 0x5629, 0x5641,
    0x5645, 0x5646, 0x5648, 0x5649, 0x564a, 0x5650, 0x5651, 0x5652, 0x5654, 0x5655, 0x5656, 0x5658,
    0x5659, 0x565a, 0x5661, 0x5664, 0x5665, 0x5669, 0x5682, 0x5685, 0x5686, 0x5688, 0x5689, 0x568a,
    0x5691, 0x5695, 0x569a, 0x56a2, 0x56a5, 0x56a6, 0x56a8, 0x56a9, 0x5804, 0x5805, 0x5806, 0x5809,
    0x5810, 0x5815, 0x5818, 0x5821, 0x582a, 0x5845, 0x5848, 0x584a, 0x5851, 0x5854, 0x5855, 0x5856,
    0x5858, 0x5859, 0x5860, 0x5862, 0x5864, 0x5865, 0x5882, 0x5889, 0x5890, 0x5892, 0x5895, 0x5898,
    0x58a1, 0x58a9, 0x5901, 0x5902, 0x5905, 0x590a, 0x5911, 0x5914, 0x5915, 0x5916, 0x5919, 0x5925,
    0x5941, 0x5944, 0x5945, 0x5946, 0x5949, 0x5950, 0x5951, 0x5952, 0x5954, 0x5955, 0x5956, 0x5958,
    0x5959, 0x595a, 0x5961, 0x5964, 0x5965, 0x5966, 0x5969, 0x5981, 0x5985, 0x5989, 0x5991, 0x5994,
    0x5995, 0x5996, 0x5998, 0x5999, 0x59a5, 0x5a04, 0x5a08, 0x5a15, 0x5a1a, 0x5a20, 0x5a25, 0x5a26,
    0x5a29, 0x5a45, 0x5a48, 0x5a49, 0x5a51, 0x5a55, 0x5a56, 0x5a58, 0x5a59, 0x5a62, 0x5a65, 0x5a68,
    0x5a6a, 0x5a81, 0x5a8a, 0x5a92, 0x5a95, 0x5a96, 0x5a98, 0x5a9a, 0x5aa1, 0x6005, 0x6014, 0x6016,
    0x6019, 0x6025, 0x6044, 0x6050, 0x6055, 0x6056, 0x6058, 0x605a, 0x6061, 0x6064, 0x6066, 0x6069,
    0x6081, 0x6096, 0x60a5, 0x6101, 0x6104, 0x6106, 0x6109, 0x6112, 0x6115, 0x6121, 0x6122, 0x6126,
    0x6129, 0x6145, 0x6149, 0x6151, 0x6155, 0x6156, 0x6159, 0x6165, 0x6166, 0x616a, 0x6184, 0x618a,
    0x6192, 0x6195, 0x61a1, 0x61a6, 0x61a9, 0x6211, 0x6216, 0x6219, 0x6240, 0x6241, 0x6246, 0x6255,
    0x6256, 0x6258, 0x6260, 0x6285, 0x6291, 0x6296, 0x62a5, 0x6411, 0x6412, 0x6415, 0x6416, 0x641a,
    0x6421, 0x6426, 0x6429, 0x6440, 0x6442, 0x6445, 0x6448, 0x644a, 0x6451, 0x6454, 0x6455, 0x6456,
    0x6459, 0x645a, 0x6460, 0x6462, 0x6465, 0x6484, 0x6485, 0x6489, 0x6490, 0x6492, 0x6494, 0x6495,
    0x6496, 0x6498, 0x649a, 0x64a1, 0x64a4, 0x64a9, 0x6505, 0x6508, 0x650a, 0x6511, 0x6515, 0x6516,
    0x6519, 0x6544, 0x6545, 0x6546, 0x6549, 0x6550, 0x6551, 0x6554, 0x6555, 0x6556, 0x6559, 0x6561,
    0x6564, 0x6565, 0x6566, 0x6569, 0x6586, 0x6589, 0x658a, 0x6591, 0x6595, 0x6596, 0x6599, 0x659a,
    0x65a2, 0x65a5, 0x65a6, 0x65a8, 0x6602, 0x6609, 0x6615, 0x6620, 0x6626, 0x6628, 0x6629, 0x6640,
    0x6645, 0x6648, 0x664a, 0x6651, 0x6654, 0x6655, 0x6656, 0x6658, 0x665a, 0x6660, 0x6665, 0x6668,
    0x6680, 0x6682, 0x6685, 0x668a, 0x6694, 0x6696, 0x6698, 0x6699, 0x66a0, 0x66a4, 0x66a6, 0x66aa,
    0x6816, 0x6819, 0x6825, 0x6841, 0x6852, 0x6855, 0x685a, 0x6861, 0x6869, 0x6885, 0x6891, 0x6898,
    0x68a6, 0x6901, 0x6904, 0x6910, 0x6915, 0x6921, 0x6924, 0x6926, 0x6929, 0x6940, 0x6941, 0x6945,
    0x6946, 0x6948, 0x6951, 0x6954, 0x6955, 0x6956, 0x6959, 0x6960, 0x6965, 0x696a, 0x6982, 0x6984,
    0x698a, 0x6995, 0x69a1, 0x69a4, 0x69a5, 0x69a9, 0x6a11, 0x6a16, 0x6a18, 0x6a41, 0x6a44, 0x6a49,
    0x6a50, 0x6a55, 0x6a58, 0x6a5a, 0x6a64, 0x6a65, 0x6a69, 0x6a86, 0x6a94, 0x6a98, 0x6a9a, 0x6aa6,
    0x8000, 0x8002, 0x8008, 0x800a, 0x8020, 0x8022, 0x8028, 0x802a, 0x8045, 0x8050, 0x8051, 0x8054,
    0x8056, 0x8059, 0x8065, 0x8080, 0x8082, 0x8088, 0x808a, 0x8095, 0x80a0, 0x80a2, 0x80a8, 0x80aa,
    0x8105, 0x8111, 0x8114, 0x8116, 0x8119, 0x8125, 0x8141, 0x8144, 0x8149, 0x8150, 0x8152, 0x8155,
    0x8156, 0x8158, 0x8159, 0x8164, 0x8166, 0x8169, 0x8185, 0x8189, 0x8194, 0x8196, 0x8199, 0x81a5,
    0x8200, 0x8202, 0x8208, 0x820a, 0x8215, 0x8220, 0x8222, 0x8228, 0x822a, 0x8251, 0x8254, 0x8259,
    0x8265, 0x8280, 0x8282, 0x8288, 0x828a, 0x8295, 0x82a0, 0x82a2, 0x82a8, 0x82aa, 0x8414, 0x8419,
    0x8441, 0x8444, 0x8451, 0x8455, 0x845a, 0x8461, 0x8464, 0x8469, 0x8494, 0x8499, 0x8501, 0x8509,
    0x8512, 0x8515, 0x851a, 0x8526, 0x8529, 0x8540, 0x8541, 0x8545, 0x8548, 0x8551, 0x8554, 0x8555,
    0x8556, 0x8559, 0x855a, 0x8565, 0x8566, 0x8568, 0x856a, 0x8581, 0x8584, 0x8586, 0x8589, 0x8590,
    0x8592, 0x8595, 0x8598, 0x85a6, 0x8611, 0x8616, 0x8619, 0x8625, 0x8641, 0x8644, 0x8649, 0x864a,
    0x8650, 0x8655, 0x8659, 0x865a, 0x8661, 0x8666, 0x866a, 0x8685, 0x8691, 0x869a, 0x86a4, 0x8800,
    0x8802, 0x8808, 0x880a, 0x8815, 0x8820, 0x8822, 0x8828, 0x882a, 0x8841, 0x8845, 0x8851, 0x8854,
    0x8859, 0x8865, 0x8869, 0x8880, 0x8882, 0x8888, 0x888a, 0x8895, 0x88a0, 0x88a2, 0x88a8, 0x88aa,
    0x8905, 0x8906, 0x8911, 0x8914, 0x8916, 0x8925, 0x8941, 0x8944, 0x8946, 0x8949, 0x8950, 0x8952,
    0x8955, 0x895a, 0x8961, 0x8964, 0x8985, 0x8996, 0x8999, 0x89a5, 0x8a00, 0x8a02, 0x8a08, 0x8a0a,
    0x8a15, 0x8a20, 0x8a22, 0x8a28, 0x8a2a, 0x8a45, 0x8a51, 0x8a54, 0x8a56, 0x8a80, 0x8a82, 0x8a88,
    0x8a8a, 0x8a95, 0x8aa0, 0x8aa2, 0x8aa8, 0x8aaa, 0x9005, 0x9011, 0x9016, 0x9018, 0x9019, 0x9025,
    0x9041, 0x9046, 0x9049, 0x9055, 0x9058, 0x905a, 0x9069, 0x906a, 0x9085, 0x9091, 0x9094, 0x9096,
    0x9099, 0x90a5, 0x9101, 0x9104, 0x9106, 0x9109, 0x9110, 0x9115, 0x9118, 0x911a, 0x9121, 0x9124,
    0x9126, 0x9129, 0x9140, 0x9145, 0x9150, 0x9151, 0x9154, 0x9155, 0x9156, 0x9159, 0x9162, 0x9165,
    0x9184, 0x9186, 0x9192, 0x9195, 0x9198, 0x91a1, 0x91a4, 0x91a6, 0x91a9, 0x9205, 0x9211, 0x9214,
    0x9219, 0x9225, 0x9244, 0x9246, 0x9249, 0x9250, 0x9252, 0x9255, 0x9258, 0x9266, 0x9269, 0x9285,
    0x9294, 0x9296, 0x92a9, 0x9401, 0x9404, 0x9406, 0x9410, 0x9415, 0x9418, 0x9426, 0x9440, 0x944a,
    0x9451, 0x9454, 0x9455, 0x9456, 0x9458, 0x9459, 0x9460, 0x9461, 0x9462, 0x9465, 0x9484, 0x9486,
    0x9492, 0x9494, 0x9495, 0x9498, 0x94a1, 0x94a9, 0x9500, 0x9505, 0x9508, 0x950a, 0x9510, 0x9511,
    0x9514, 0x9515, 0x9516, 0x9519, 0x9521, 0x9525, 0x9529, 0x952a, 0x9541, 0x9544, 0x9545, 0x9546,
    0x9549, 0x9550, 0x9551, 0x9552, 0x9554, 0x9555, 0x9556, 0x9558, 0x9559, 0x955a, 0x9561, 0x9564,
    0x9565, 0x9566, 0x9569, 0x9581, 0x9585, 0x9588, 0x9591, 0x9592, 0x9594, 0x9595, 0x9596, 0x9599,
    0x959a, 0x95a0, 0x95a2, 0x95a5, 0x95a8, 0x95aa, 0x9601, 0x9604, 0x9610, 0x9615, 0x9619, 0x9620,
    0x9626, 0x9629, 0x9645, 0x9648, 0x9649, 0x9651, 0x9652, 0x9655, 0x9656, 0x9659, 0x9665, 0x9668,
    0x9682, 0x9684, 0x9689, 0x968a, 0x9692, 0x9694, 0x9695, 0x96a4, 0x96a6, 0x96a9, 0x9805, 0x9816,
    0x9819, 0x9825, 0x9841, 0x9846, 0x9850, 0x9852, 0x9855, 0x9856, 0x985a, 0x9864, 0x9865, 0x9885,
    0x9891, 0x9896, 0x9899, 0x98a5, 0x9904, 0x9906, 0x9909, 0x9910, 0x9912, 0x9915, 0x9918, 0x991a,
    0x9920, 0x9921, 0x9924, 0x9926, 0x9940, 0x9942, 0x9945, 0x9948, 0x994a, 0x9951, 0x9954, 0x9955,
    0x9956, 0x9959, 0x9962, 0x9965, 0x9966, 0x996a, 0x9981, 0x9984, 0x9990, 0x9992, 0x9995, 0x999a,
    0x99a1, 0x99a6, 0x9a05, 0x9a15, 0x9a25, 0x9a44, 0x9a46, 0x9a49, 0x9a50, 0x9a55, 0x9a58, 0x9a61,
    0x9a85, 0x9a91, 0x9a94, 0x9a95, 0x9a96, 0xa000, 0xa002, 0xa008, 0xa00a, 0xa015, 0xa020, 0xa022,
    0xa028, 0xa02a, 0xa045, 0xa051, 0xa054, 0xa056, 0xa059, 0xa080, 0xa082, 0xa088, 0xa08a, 0xa095,
    0xa0a0, 0xa0a2, 0xa0a8, 0xa0aa, 0xa105, 0xa109, 0xa111, 0xa114, 0xa116, 0xa119, 0xa11a, 0xa146,
    0xa149, 0xa151, 0xa155, 0xa158, 0xa15a, 0xa161, 0xa164, 0xa185, 0xa190, 0xa192, 0xa196, 0xa199,
    0xa202, 0xa208, 0xa20a, 0xa210, 0xa219, 0xa222, 0xa228, 0xa22a, 0xa245, 0xa251, 0xa256, 0xa259,
    0xa265, 0xa280, 0xa282, 0xa288, 0xa28a, 0xa295, 0xa2a0, 0xa2a2, 0xa2a8, 0xa2aa, 0xa419, 0xa425,
    0xa441, 0xa444, 0xa450, 0xa454, 0xa455, 0xa458, 0xa45a, 0xa461, 0xa465, 0xa466, 0xa468, 0xa469,
    0xa485, 0xa506, 0xa509, 0xa510, 0xa512, 0xa515, 0xa518, 0xa526, 0xa529, 0xa542, 0xa545, 0xa551,
    0xa554, 0xa555, 0xa556, 0xa559, 0xa565, 0xa56a, 0xa581, 0xa584, 0xa585, 0xa586, 0xa589, 0xa592,
    0xa595, 0xa598, 0xa605, 0xa611, 0xa616, 0xa61a, 0xa621, 0xa625, 0xa644, 0xa646, 0xa64a, 0xa652,
    0xa655, 0xa656, 0xa658, 0xa660, 0xa662, 0xa686, 0xa690, 0xa695, 0xa696, 0xa699, 0xa6a1, 0xa6a4,
    0xa6a6, 0xa800, 0xa802, 0xa808, 0xa80a, 0xa820, 0xa822, 0xa828, 0xa82a, 0xa851, 0xa854, 0xa856,
    0xa859, 0xa880, 0xa882, 0xa888, 0xa88a, 0xa895, 0xa8a0, 0xa8a2, 0xa8a8, 0xa8aa, 0xa905, 0xa914,
    0xa919, 0xa921, 0xa925, 0xa941, 0xa950, 0xa955, 0xa95a, 0xa961, 0xa966, 0xa969, 0xa990, 0xa996,
    0xaa00, 0xaa02, 0xaa08, 0xaa0a, 0xaa20, 0xaa22, 0xaa28, 0xaa2a, 0xaa51, 0xaa54, 0xaa56, 0xaa80,
    0xaa82, 0xaa88, 0xaa8a, 0xaa95, 0xaaa0, 0xaaa2, 0xaaa8, 0xaaaa,
};

__device__ const unsigned short IQ2XXS_GRID[256] = {
    0x0000, 0x0002, 0x0005, 0x0008, 0x000a, 0x0011, 0x0014, 0x0020, 0x0022, 0x0028, 0x002a, 0x0041,
    0x0044, 0x0050, 0x0058, 0x0061, 0x0064, 0x0080, 0x0082, 0x008a, 0x00a2, 0x0101, 0x0104, 0x0110,
    0x0115, 0x0140, 0x0184, 0x0198, 0x0200, 0x0202, 0x0222, 0x0282, 0x0401, 0x0404, 0x0410, 0x0421,
    0x0424, 0x0440, 0x0442, 0x0448, 0x0460, 0x0481, 0x0484, 0x0490, 0x04a4, 0x0500, 0x0502, 0x0508,
    0x0520, 0x0546, 0x0569, 0x0580, 0x0591, 0x0609, 0x0610, 0x0640, 0x0684, 0x06a4, 0x0800, 0x0805,
    0x0808, 0x0814, 0x0828, 0x0841, 0x0844, 0x0850, 0x0852, 0x0888, 0x0904, 0x0940, 0x0a02, 0x0a14,
    0x1001, 0x1004, 0x1010, 0x1021, 0x1040, 0x1060, 0x1084, 0x1090, 0x1095, 0x1100, 0x1108, 0x1120,
    0x1150, 0x115a, 0x1180, 0x1224, 0x1245, 0x1400, 0x1408, 0x1420, 0x1425, 0x1449, 0x1480, 0x1518,
    0x1562, 0x1600, 0x1616, 0x1801, 0x1804, 0x1810, 0x1840, 0x1881, 0x1900, 0x1905, 0x19a0, 0x1a51,
    0x2000, 0x2002, 0x200a, 0x2044, 0x2061, 0x2080, 0x2082, 0x2129, 0x2148, 0x2200, 0x2202, 0x2401,
    0x2404, 0x2410, 0x2440, 0x2456, 0x2500, 0x2541, 0x2564, 0x2690, 0x2808, 0x2820, 0x2894, 0x2a44,
    0x4001, 0x4004, 0x4010, 0x4018, 0x4021, 0x4024, 0x4040, 0x4048, 0x4056, 0x4060, 0x4081, 0x4084,
    0x4090, 0x4100, 0x4120, 0x4161, 0x4180, 0x4185, 0x4201, 0x4210, 0x4248, 0x4256, 0x4268, 0x4400,
    0x4408, 0x4420, 0x4480, 0x4499, 0x4512, 0x4524, 0x4600, 0x4801, 0x4804, 0x4810, 0x4840, 0x4845,
    0x4900, 0x4958, 0x4961, 0x4982, 0x4a45, 0x4a90, 0x5000, 0x5008, 0x5011, 0x5019, 0x5020, 0x5080,
    0x5088, 0x5104, 0x5142, 0x51a4, 0x5291, 0x5490, 0x5492, 0x550a, 0x5601, 0x5654, 0x5800, 0x5811,
    0x5819, 0x5864, 0x5940, 0x5a08, 0x6004, 0x6010, 0x6040, 0x6068, 0x6100, 0x6155, 0x6218, 0x6260,
    0x6400, 0x6405, 0x6510, 0x6512, 0x6584, 0x6842, 0x8000, 0x8002, 0x800a, 0x8041, 0x8082, 0x8104,
    0x8118, 0x8140, 0x8211, 0x8401, 0x8404, 0x8410, 0x8415, 0x8440, 0x8460, 0x8500, 0x8546, 0x8594,
    0x8609, 0x8640, 0x8660, 0x8802, 0x8904, 0x8a11, 0x9004, 0x9010, 0x9024, 0x9040, 0x90a1, 0x9116,
    0x9180, 0x9245, 0x9400, 0x9422, 0x9444, 0x9551, 0x9881, 0x9920, 0xa002, 0xa050, 0xa085, 0xa109,
    0xa200, 0xa418, 0xa850, 0xa904,
};

__device__ const unsigned short IQ2XS_GRID[512] = {
    0x0000, 0x0002, 0x0005, 0x0008, 0x000a, 0x0011, 0x0014, 0x0016, 0x0019, 0x0020, 0x0022, 0x0025,
    0x0028, 0x0041, 0x0044, 0x0046, 0x0049, 0x0050, 0x0052, 0x0055, 0x0058, 0x0061, 0x0064, 0x0080,
    0x0082, 0x0085, 0x0088, 0x0091, 0x0094, 0x0099, 0x00a0, 0x0101, 0x0104, 0x0106, 0x0109, 0x0110,
    0x0112, 0x0115, 0x0118, 0x011a, 0x0121, 0x0124, 0x0140, 0x0142, 0x0145, 0x0148, 0x0151, 0x0154,
    0x0160, 0x0168, 0x0181, 0x0184, 0x0190, 0x0200, 0x0202, 0x0205, 0x0208, 0x0211, 0x0214, 0x0220,
    0x0241, 0x0244, 0x0250, 0x0255, 0x0280, 0x028a, 0x0401, 0x0404, 0x0406, 0x0409, 0x0410, 0x0412,
    0x0415, 0x0418, 0x0421, 0x0424, 0x0440, 0x0442, 0x0445, 0x0448, 0x0451, 0x0454, 0x0456, 0x0460,
    0x0481, 0x0484, 0x0490, 0x0500, 0x0502, 0x0505, 0x0508, 0x0511, 0x0514, 0x0520, 0x0541, 0x0544,
    0x0550, 0x0561, 0x0580, 0x0601, 0x0604, 0x0610, 0x0626, 0x0640, 0x0642, 0x0684, 0x0800, 0x0802,
    0x0805, 0x0808, 0x080a, 0x0811, 0x0814, 0x0820, 0x0825, 0x0841, 0x0844, 0x0850, 0x0858, 0x0880,
    0x08a0, 0x08aa, 0x0901, 0x0904, 0x0910, 0x0940, 0x0981, 0x0989, 0x0a00, 0x0a20, 0x0a28, 0x0a96,
    0x0aa0, 0x1001, 0x1004, 0x1006, 0x1009, 0x1010, 0x1012, 0x1015, 0x1018, 0x1021, 0x1024, 0x1040,
    0x1042, 0x1045, 0x1048, 0x1051, 0x1054, 0x1060, 0x106a, 0x1081, 0x1084, 0x1090, 0x1100, 0x1102,
    0x1105, 0x1108, 0x1111, 0x1114, 0x1120, 0x1141, 0x1144, 0x1150, 0x1180, 0x1194, 0x1196, 0x1201,
    0x1204, 0x1206, 0x1210, 0x1240, 0x1260, 0x1400, 0x1402, 0x1405, 0x1408, 0x1411, 0x1414, 0x1420,
    0x1441, 0x1444, 0x1449, 0x1450, 0x1464, 0x1480, 0x1501, 0x1504, 0x1510, 0x1540, 0x1600, 0x1614,
    0x1649, 0x1801, 0x1804, 0x1810, 0x1812, 0x1840, 0x1854, 0x1886, 0x1900, 0x1905, 0x1966, 0x1a51,
    0x1aa9, 0x2000, 0x2002, 0x2005, 0x2008, 0x200a, 0x2011, 0x2014, 0x2020, 0x2041, 0x2044, 0x2050,
    0x2080, 0x20a0, 0x2101, 0x2104, 0x2110, 0x2140, 0x2148, 0x2165, 0x2200, 0x2222, 0x2280, 0x22a8,
    0x2401, 0x2404, 0x2410, 0x2429, 0x2440, 0x2500, 0x2541, 0x2552, 0x2599, 0x2601, 0x261a, 0x26a6,
    0x2800, 0x2808, 0x280a, 0x2820, 0x2855, 0x2888, 0x28a2, 0x2968, 0x2990, 0x2a08, 0x2a20, 0x2a82,
    0x2a88, 0x2a8a, 0x4001, 0x4004, 0x4006, 0x4009, 0x4010, 0x4012, 0x4015, 0x4018, 0x4021, 0x4024,
    0x4040, 0x4042, 0x4045, 0x4048, 0x404a, 0x4051, 0x4054, 0x4060, 0x4065, 0x4081, 0x4084, 0x4090,
    0x4100, 0x4102, 0x4105, 0x4108, 0x4111, 0x4114, 0x4120, 0x4141, 0x4144, 0x4150, 0x4180, 0x4185,
    0x41a2, 0x4201, 0x4204, 0x4210, 0x4212, 0x4229, 0x4240, 0x4400, 0x4402, 0x4405, 0x4408, 0x4411,
    0x4414, 0x4419, 0x4420, 0x4441, 0x4444, 0x4450, 0x4480, 0x4494, 0x4501, 0x4504, 0x4510, 0x4524,
    0x4540, 0x459a, 0x4600, 0x460a, 0x4644, 0x4650, 0x4801, 0x4804, 0x4810, 0x4840, 0x4845, 0x4854,
    0x4862, 0x4900, 0x4911, 0x4944, 0x4950, 0x4969, 0x4a04, 0x5000, 0x5002, 0x5005, 0x5008, 0x5011,
    0x5014, 0x5020, 0x5028, 0x5041, 0x5044, 0x5050, 0x5080, 0x5101, 0x5104, 0x5110, 0x5115, 0x5140,
    0x5142, 0x5200, 0x5244, 0x52aa, 0x5401, 0x5404, 0x5410, 0x5421, 0x5440, 0x5460, 0x5481, 0x54a1,
    0x5500, 0x5508, 0x5580, 0x5588, 0x5621, 0x5668, 0x56a1, 0x5800, 0x5814, 0x5841, 0x5850, 0x5899,
    0x591a, 0x5940, 0x5942, 0x5a85, 0x6001, 0x6004, 0x6010, 0x6040, 0x6054, 0x6062, 0x6086, 0x60a9,
    0x6100, 0x6224, 0x624a, 0x6292, 0x6400, 0x6416, 0x6510, 0x6540, 0x6545, 0x65a4, 0x6801, 0x686a,
    0x6925, 0x6a06, 0x6a54, 0x6a62, 0x8000, 0x8002, 0x8005, 0x8008, 0x8011, 0x8014, 0x8020, 0x802a,
    0x8041, 0x8044, 0x8050, 0x8080, 0x8082, 0x80a8, 0x80aa, 0x8101, 0x8104, 0x8106, 0x8110, 0x8140,
    0x8151, 0x8159, 0x8200, 0x8220, 0x8280, 0x8282, 0x82a0, 0x82a8, 0x8401, 0x8404, 0x8410, 0x8412,
    0x8415, 0x8440, 0x8460, 0x8489, 0x8500, 0x8544, 0x85a5, 0x8618, 0x866a, 0x8800, 0x8808, 0x8825,
    0x885a, 0x8880, 0x8882, 0x88a8, 0x8906, 0x8a22, 0x8a80, 0x8a88, 0x8a96, 0x8aa8, 0x9001, 0x9004,
    0x9010, 0x9040, 0x9056, 0x9084, 0x9100, 0x9122, 0x9164, 0x9256, 0x9289, 0x9400, 0x9405, 0x9444,
    0x9450, 0x9458, 0x9529, 0x9590, 0x9592, 0x9641, 0x9851, 0x98a6, 0x9949, 0x9a15, 0x9a60, 0xa000,
    0xa002, 0xa008, 0xa00a, 0xa020, 0xa02a, 0xa0a0, 0xa151, 0xa159, 0xa1a6, 0xa200, 0xa202, 0xa208,
    0xa22a, 0xa280, 0xa2a0, 0xa440, 0xa495, 0xa665, 0xa698, 0xa80a, 0xa820, 0xa822, 0xa828, 0xa8a0,
    0xa8a8, 0xa904, 0xa984, 0xa986, 0xaa28, 0xaa2a, 0xaa91, 0xaaaa,
};

__device__ const unsigned short IQ2S_GRID[1024] = {
    0x0000, 0x0002, 0x0005, 0x0008, 0x000a, 0x0011, 0x0014, 0x0016, 0x0019, 0x0020, 0x0022, 0x0025,
    0x0028, 0x0041, 0x0044, 0x0046, 0x0049, 0x0050, 0x0052, 0x0055, 0x0058, 0x0061, 0x0064, 0x0066,
    0x0069, 0x0080, 0x0082, 0x0085, 0x0088, 0x0091, 0x0094, 0x00a0, 0x00a5, 0x00aa, 0x0101, 0x0104,
    0x0106, 0x0109, 0x0110, 0x0112, 0x0115, 0x0118, 0x0121, 0x0124, 0x0140, 0x0142, 0x0145, 0x0148,
    0x0151, 0x0154, 0x0156, 0x0159, 0x0160, 0x0165, 0x0168, 0x0181, 0x0184, 0x0190, 0x0192, 0x0195,
    0x01a1, 0x01a4, 0x0200, 0x0202, 0x0205, 0x0208, 0x0211, 0x0214, 0x0220, 0x022a, 0x0241, 0x0244,
    0x0246, 0x0249, 0x0250, 0x0255, 0x0280, 0x0285, 0x028a, 0x0294, 0x02a2, 0x0401, 0x0404, 0x0406,
    0x0409, 0x0410, 0x0412, 0x0415, 0x0418, 0x0421, 0x0424, 0x0426, 0x0429, 0x0440, 0x0442, 0x0445,
    0x0448, 0x044a, 0x0451, 0x0454, 0x0456, 0x0459, 0x0460, 0x0462, 0x0465, 0x0481, 0x0484, 0x0486,
    0x0489, 0x0490, 0x0495, 0x0498, 0x04a1, 0x04a4, 0x0500, 0x0502, 0x0505, 0x0508, 0x050a, 0x0511,
    0x0514, 0x0516, 0x0519, 0x0520, 0x0525, 0x0528, 0x0541, 0x0544, 0x0546, 0x0549, 0x0550, 0x0552,
    0x0555, 0x0558, 0x0561, 0x0564, 0x0580, 0x0582, 0x0585, 0x0588, 0x0591, 0x0594, 0x05a0, 0x0601,
    0x0604, 0x0606, 0x0609, 0x0610, 0x0615, 0x0640, 0x0645, 0x0648, 0x0651, 0x0654, 0x0660, 0x0681,
    0x0684, 0x0690, 0x0800, 0x0802, 0x0805, 0x0808, 0x0811, 0x0814, 0x0816, 0x0819, 0x0820, 0x0825,
    0x082a, 0x0841, 0x0844, 0x0846, 0x0849, 0x0850, 0x0852, 0x0855, 0x0858, 0x0861, 0x0864, 0x0880,
    0x0885, 0x0894, 0x08aa, 0x0901, 0x0904, 0x0910, 0x0912, 0x0915, 0x0918, 0x0921, 0x0940, 0x0945,
    0x0948, 0x0951, 0x0954, 0x0960, 0x0981, 0x0990, 0x0a00, 0x0a11, 0x0a14, 0x0a22, 0x0a28, 0x0a2a,
    0x0a50, 0x0a99, 0x1001, 0x1004, 0x1006, 0x1009, 0x1010, 0x1012, 0x1015, 0x1018, 0x1021, 0x1024,
    0x1026, 0x1040, 0x1042, 0x1045, 0x1048, 0x1051, 0x1054, 0x1056, 0x1059, 0x1060, 0x1062, 0x1065,
    0x1068, 0x1081, 0x1084, 0x1086, 0x1090, 0x1095, 0x1098, 0x10a1, 0x10a4, 0x1100, 0x1102, 0x1105,
    0x1108, 0x110a, 0x1111, 0x1114, 0x1116, 0x1119, 0x1120, 0x1122, 0x1125, 0x1128, 0x1141, 0x1144,
    0x1146, 0x1149, 0x1150, 0x1152, 0x1155, 0x1158, 0x1161, 0x1164, 0x1180, 0x1182, 0x1185, 0x1188,
    0x1191, 0x1194, 0x1201, 0x1204, 0x1209, 0x1210, 0x1215, 0x1221, 0x1224, 0x1240, 0x1245, 0x1251,
    0x1254, 0x1281, 0x1284, 0x1290, 0x1400, 0x1402, 0x1405, 0x1408, 0x1411, 0x1414, 0x1416, 0x1419,
    0x1420, 0x1425, 0x1428, 0x1441, 0x1444, 0x1446, 0x1449, 0x1450, 0x1452, 0x1455, 0x1458, 0x1461,
    0x1464, 0x1480, 0x1482, 0x1485, 0x1488, 0x1491, 0x1494, 0x14a0, 0x1501, 0x1504, 0x1506, 0x1509,
    0x1510, 0x1512, 0x1515, 0x1518, 0x1521, 0x1524, 0x1540, 0x1542, 0x1545, 0x1548, 0x1551, 0x1554,
    0x1560, 0x1581, 0x1584, 0x1590, 0x1600, 0x1605, 0x1608, 0x1611, 0x1614, 0x1620, 0x1641, 0x1644,
    0x1650, 0x1680, 0x16aa, 0x1801, 0x1804, 0x1806, 0x1809, 0x1810, 0x1815, 0x1818, 0x1821, 0x1840,
    0x1842, 0x1845, 0x1848, 0x1851, 0x1854, 0x1860, 0x1881, 0x1884, 0x1900, 0x1902, 0x1905, 0x1908,
    0x1911, 0x1914, 0x1920, 0x1941, 0x1944, 0x1950, 0x1969, 0x19a2, 0x1a04, 0x1a10, 0x1a40, 0x1a56,
    0x2000, 0x2002, 0x2005, 0x2008, 0x2011, 0x2014, 0x2016, 0x2019, 0x2020, 0x2025, 0x202a, 0x2041,
    0x2044, 0x2050, 0x2052, 0x2055, 0x2064, 0x2080, 0x208a, 0x2094, 0x20aa, 0x2101, 0x2104, 0x2110,
    0x2112, 0x2115, 0x2121, 0x2140, 0x2142, 0x2145, 0x2151, 0x2154, 0x2160, 0x2181, 0x2184, 0x2190,
    0x2200, 0x220a, 0x2222, 0x2228, 0x222a, 0x2244, 0x2250, 0x2288, 0x228a, 0x22a8, 0x2401, 0x2404,
    0x2406, 0x2409, 0x2410, 0x2415, 0x2418, 0x2421, 0x2424, 0x2440, 0x2442, 0x2445, 0x2448, 0x2451,
    0x2454, 0x2460, 0x2481, 0x2484, 0x2490, 0x2500, 0x2505, 0x2508, 0x2511, 0x2514, 0x2520, 0x2541,
    0x2544, 0x2550, 0x2566, 0x2580, 0x2601, 0x2604, 0x2610, 0x2640, 0x2659, 0x2800, 0x2805, 0x2811,
    0x2814, 0x2841, 0x2844, 0x2850, 0x288a, 0x28aa, 0x2901, 0x2904, 0x2910, 0x2995, 0x2a0a, 0x2a22,
    0x2a64, 0x2a88, 0x2a8a, 0x4001, 0x4004, 0x4006, 0x4009, 0x4010, 0x4012, 0x4015, 0x4018, 0x401a,
    0x4021, 0x4024, 0x4026, 0x4040, 0x4042, 0x4045, 0x4048, 0x404a, 0x4051, 0x4054, 0x4056, 0x4059,
    0x4060, 0x4062, 0x4065, 0x4081, 0x4084, 0x4090, 0x4095, 0x4098, 0x40a1, 0x40a4, 0x4100, 0x4102,
    0x4105, 0x4108, 0x4111, 0x4114, 0x4116, 0x4119, 0x4120, 0x4122, 0x4125, 0x4141, 0x4144, 0x4146,
    0x4149, 0x4150, 0x4152, 0x4155, 0x4158, 0x4161, 0x4164, 0x4180, 0x4182, 0x4185, 0x4188, 0x4191,
    0x4194, 0x41a0, 0x4201, 0x4204, 0x4210, 0x4212, 0x4215, 0x4218, 0x4224, 0x4240, 0x4245, 0x4248,
    0x4251, 0x4254, 0x4260, 0x4281, 0x4284, 0x4400, 0x4402, 0x4405, 0x4408, 0x440a, 0x4411, 0x4414,
    0x4416, 0x4419, 0x4420, 0x4422, 0x4425, 0x4428, 0x4441, 0x4444, 0x4446, 0x4449, 0x4450, 0x4452,
    0x4455, 0x4458, 0x4461, 0x4464, 0x4480, 0x4482, 0x4485, 0x4488, 0x4491, 0x4494, 0x44a0, 0x4501,
    0x4504, 0x4506, 0x4509, 0x4510, 0x4512, 0x4515, 0x4518, 0x4521, 0x4524, 0x4540, 0x4542, 0x4545,
    0x4548, 0x4551, 0x4554, 0x4560, 0x456a, 0x4581, 0x4584, 0x4590, 0x4600, 0x4602, 0x4605, 0x4608,
    0x4611, 0x4614, 0x4620, 0x4641, 0x4644, 0x4650, 0x4680, 0x46a5, 0x4801, 0x4804, 0x4809, 0x4810,
    0x4812, 0x4815, 0x4818, 0x4821, 0x4824, 0x4840, 0x4842, 0x4845, 0x4848, 0x4851, 0x4854, 0x4860,
    0x4884, 0x4890, 0x4900, 0x4902, 0x4905, 0x4908, 0x4911, 0x4914, 0x4920, 0x4941, 0x4944, 0x4950,
    0x4980, 0x4996, 0x4a01, 0x4a04, 0x4a10, 0x4a40, 0x5000, 0x5002, 0x5005, 0x5008, 0x5011, 0x5014,
    0x5016, 0x5019, 0x5020, 0x5022, 0x5025, 0x5028, 0x5041, 0x5044, 0x5046, 0x5049, 0x5050, 0x5052,
    0x5055, 0x5058, 0x5061, 0x5064, 0x5080, 0x5082, 0x5085, 0x5088, 0x5091, 0x5094, 0x5101, 0x5104,
    0x5106, 0x5109, 0x5110, 0x5112, 0x5115, 0x5118, 0x5121, 0x5124, 0x5140, 0x5142, 0x5145, 0x5148,
    0x5151, 0x5154, 0x5160, 0x5181, 0x5184, 0x5190, 0x5200, 0x5205, 0x5208, 0x5211, 0x5214, 0x5220,
    0x5241, 0x5244, 0x5250, 0x5269, 0x5280, 0x5401, 0x5404, 0x5406, 0x5409, 0x5410, 0x5412, 0x5415,
    0x5418, 0x5421, 0x5424, 0x5440, 0x5442, 0x5445, 0x5448, 0x5451, 0x5454, 0x5460, 0x5481, 0x5484,
    0x5490, 0x5500, 0x5502, 0x5505, 0x5508, 0x5511, 0x5514, 0x5520, 0x5541, 0x5544, 0x5550, 0x5580,
    0x5601, 0x5604, 0x5610, 0x5626, 0x5640, 0x5800, 0x5802, 0x5805, 0x5808, 0x5811, 0x5814, 0x5820,
    0x5841, 0x5844, 0x5850, 0x585a, 0x5880, 0x5901, 0x5904, 0x5910, 0x5940, 0x5a00, 0x5a19, 0x5a85,
    0x5aa8, 0x6001, 0x6004, 0x6006, 0x6010, 0x6012, 0x6015, 0x6018, 0x6021, 0x6024, 0x6040, 0x6045,
    0x6048, 0x6051, 0x6054, 0x6060, 0x6084, 0x6090, 0x6100, 0x6102, 0x6105, 0x6108, 0x6111, 0x6114,
    0x6120, 0x6141, 0x6144, 0x6150, 0x6180, 0x6199, 0x6204, 0x6210, 0x6240, 0x6256, 0x62a1, 0x6400,
    0x6405, 0x6408, 0x6411, 0x6414, 0x6420, 0x6441, 0x6444, 0x6450, 0x6480, 0x6501, 0x6504, 0x6510,
    0x6540, 0x654a, 0x6568, 0x6592, 0x6600, 0x6694, 0x6801, 0x6804, 0x6810, 0x6865, 0x6898, 0x6900,
    0x692a, 0x6a42, 0x6aa1, 0x8000, 0x8002, 0x8005, 0x8008, 0x8011, 0x8014, 0x8019, 0x8020, 0x8025,
    0x8041, 0x8044, 0x8050, 0x8052, 0x8055, 0x8058, 0x8061, 0x8080, 0x8085, 0x8091, 0x8094, 0x8101,
    0x8104, 0x8109, 0x8110, 0x8112, 0x8115, 0x8118, 0x8121, 0x8124, 0x8140, 0x8142, 0x8145, 0x8148,
    0x8151, 0x8154, 0x8181, 0x8184, 0x8190, 0x81a9, 0x8200, 0x8205, 0x820a, 0x8211, 0x8214, 0x8241,
    0x8244, 0x8250, 0x8401, 0x8404, 0x8406, 0x8409, 0x8410, 0x8412, 0x8415, 0x8418, 0x8421, 0x8440,
    0x8442, 0x8445, 0x8448, 0x8451, 0x8454, 0x8460, 0x8481, 0x8484, 0x8490, 0x8500, 0x8502, 0x8505,
    0x8508, 0x8511, 0x8514, 0x8520, 0x8541, 0x8544, 0x8550, 0x8580, 0x858a, 0x8601, 0x8604, 0x8610,
    0x8629, 0x8640, 0x8800, 0x8805, 0x8811, 0x8814, 0x8841, 0x8844, 0x8850, 0x88a2, 0x8901, 0x8904,
    0x8940, 0x8965, 0x8a22, 0x8a58, 0x8a5a, 0x8a82, 0x8aa2, 0x9001, 0x9004, 0x9009, 0x9010, 0x9012,
    0x9015, 0x9018, 0x9024, 0x9040, 0x9042, 0x9045, 0x9048, 0x9051, 0x9054, 0x9060, 0x9081, 0x9084,
    0x9090, 0x9100, 0x9105, 0x9111, 0x9114, 0x9141, 0x9144, 0x9150, 0x915a, 0x9201, 0x9204, 0x9210,
    0x9240, 0x92a6, 0x9400, 0x9402, 0x9405, 0x9408, 0x9411, 0x9414, 0x9420, 0x9441, 0x9444, 0x9450,
    0x9480, 0x9496, 0x9501, 0x9504, 0x9510, 0x9540, 0x9598, 0x95a1, 0x9600, 0x9646, 0x9664, 0x9801,
    0x9804, 0x9810, 0x9826, 0x9840, 0x98a9, 0x9900, 0x9949, 0x9952, 0x9a90, 0xa000, 0xa005, 0xa00a,
    0xa014, 0xa022, 0xa02a, 0xa041, 0xa044, 0xa050, 0xa0a2, 0xa0aa, 0xa140, 0xa165, 0xa202, 0xa20a,
    0xa222, 0xa228, 0xa22a, 0xa282, 0xa288, 0xa28a, 0xa2a8, 0xa401, 0xa404, 0xa410, 0xa440, 0xa489,
    0xa4a4, 0xa500, 0xa519, 0xa651, 0xa80a, 0xa828, 0xa8a2, 0xa954, 0xa986, 0xaa08, 0xaa0a, 0xaa20,
    0xaa22, 0xaa28, 0xaa88, 0xaaaa,
};

__device__ const unsigned short IQ3XXS_GRID[256] = {
    0x0000, 0x0002, 0x0004, 0x0011, 0x0013, 0x0017, 0x0020, 0x0022, 0x0031, 0x0042, 0x0073, 0x0075,
    0x0101, 0x0103, 0x0110, 0x0112, 0x0121, 0x0125, 0x0130, 0x0132, 0x0141, 0x0154, 0x0170, 0x0200,
    0x0202, 0x0204, 0x0211, 0x0220, 0x0222, 0x0231, 0x0233, 0x0237, 0x0251, 0x0257, 0x0275, 0x0301,
    0x0307, 0x0310, 0x0312, 0x0325, 0x0370, 0x0413, 0x0437, 0x0444, 0x0457, 0x0473, 0x0475, 0x0501,
    0x0507, 0x0532, 0x0552, 0x0635, 0x0664, 0x0710, 0x0714, 0x0716, 0x0743, 0x0761, 0x1001, 0x1003,
    0x1010, 0x1012, 0x1021, 0x1023, 0x1030, 0x1032, 0x1034, 0x1047, 0x1050, 0x1100, 0x1102, 0x1111,
    0x1120, 0x1122, 0x1201, 0x1203, 0x1210, 0x1212, 0x1221, 0x1230, 0x1272, 0x1300, 0x1302, 0x1320,
    0x1331, 0x1346, 0x1366, 0x1401, 0x1405, 0x1450, 0x1520, 0x1524, 0x1546, 0x1571, 0x1605, 0x1722,
    0x1740, 0x2000, 0x2002, 0x2011, 0x2013, 0x2020, 0x2022, 0x2026, 0x2031, 0x2042, 0x2101, 0x2103,
    0x2105, 0x2110, 0x2112, 0x2121, 0x2130, 0x2163, 0x2167, 0x2170, 0x2200, 0x2202, 0x2211, 0x2217,
    0x2220, 0x2222, 0x2237, 0x2240, 0x2255, 0x2301, 0x2310, 0x2314, 0x2370, 0x2374, 0x2435, 0x2453,
    0x2503, 0x2527, 0x2541, 0x2574, 0x2701, 0x2703, 0x2716, 0x2745, 0x3001, 0x3010, 0x3012, 0x3021,
    0x3023, 0x3050, 0x3065, 0x3072, 0x3100, 0x3102, 0x3120, 0x3131, 0x3144, 0x3146, 0x3201, 0x3203,
    0x3210, 0x3225, 0x3252, 0x3272, 0x3311, 0x3333, 0x3430, 0x3447, 0x3472, 0x3500, 0x3506, 0x3522,
    0x3555, 0x3614, 0x3636, 0x3663, 0x3733, 0x3760, 0x4004, 0x4017, 0x4035, 0x4037, 0x4053, 0x4057,
    0x4174, 0x4220, 0x4237, 0x4240, 0x4260, 0x4266, 0x4307, 0x4345, 0x4404, 0x4451, 0x4464, 0x4525,
    0x4543, 0x4570, 0x4705, 0x4710, 0x4712, 0x4730, 0x5012, 0x5041, 0x5070, 0x5100, 0x5106, 0x5126,
    0x5155, 0x5214, 0x5232, 0x5272, 0x5302, 0x5353, 0x5410, 0x5423, 0x5427, 0x5472, 0x5502, 0x5531,
    0x5650, 0x5724, 0x5742, 0x6024, 0x6044, 0x6046, 0x6064, 0x6121, 0x6161, 0x6217, 0x6264, 0x6330,
    0x6336, 0x6444, 0x6505, 0x6552, 0x6633, 0x6703, 0x6721, 0x7003, 0x7005, 0x7007, 0x7010, 0x7032,
    0x7052, 0x7126, 0x7140, 0x7212, 0x7245, 0x7252, 0x7300, 0x7315, 0x7333, 0x7360, 0x7421, 0x7441,
    0x7500, 0x7502, 0x7524, 0x7630,
};

__device__ const unsigned short IQ3S_GRID[512] = {
    0x0000, 0x0001, 0x0002, 0x0005, 0x0007, 0x0010, 0x0011, 0x0012, 0x0014, 0x0016, 0x0020, 0x0021,
    0x0025, 0x0033, 0x0040, 0x0042, 0x0045, 0x0047, 0x0051, 0x0053, 0x0060, 0x0062, 0x0071, 0x0074,
    0x0077, 0x0100, 0x0101, 0x0102, 0x0104, 0x0110, 0x0111, 0x0115, 0x0120, 0x0123, 0x0127, 0x0131,
    0x0135, 0x0144, 0x0161, 0x0165, 0x0172, 0x0200, 0x0201, 0x0205, 0x0207, 0x0210, 0x0213, 0x0216,
    0x0221, 0x0225, 0x0230, 0x0234, 0x0242, 0x0245, 0x0247, 0x0251, 0x0253, 0x0270, 0x0273, 0x0303,
    0x0311, 0x0315, 0x0320, 0x0322, 0x0331, 0x0333, 0x0336, 0x0344, 0x0350, 0x0352, 0x0367, 0x0371,
    0x0375, 0x0400, 0x0413, 0x0417, 0x0421, 0x0424, 0x0432, 0x0440, 0x0443, 0x0451, 0x0470, 0x0502,
    0x0504, 0x0520, 0x0522, 0x0526, 0x0533, 0x0541, 0x0545, 0x0547, 0x0566, 0x0573, 0x0606, 0x0611,
    0x0613, 0x0631, 0x0652, 0x0671, 0x0700, 0x0702, 0x0704, 0x0720, 0x0722, 0x0726, 0x0733, 0x0750,
    0x0754, 0x1000, 0x1001, 0x1002, 0x1004, 0x1010, 0x1011, 0x1013, 0x1015, 0x1017, 0x1020, 0x1022,
    0x1031, 0x1034, 0x1036, 0x1054, 0x1056, 0x1061, 0x1072, 0x1100, 0x1101, 0x1103, 0x1106, 0x1110,
    0x1114, 0x1121, 0x1130, 0x1133, 0x1141, 0x1150, 0x1152, 0x1170, 0x1176, 0x1200, 0x1212, 0x1215,
    0x1217, 0x1220, 0x1224, 0x1232, 0x1240, 0x1243, 0x1255, 0x1260, 0x1272, 0x1301, 0x1304, 0x1307,
    0x1310, 0x1313, 0x1321, 0x1327, 0x1330, 0x1334, 0x1341, 0x1362, 0x1370, 0x1403, 0x1405, 0x1412,
    0x1414, 0x1431, 0x1433, 0x1442, 0x1446, 0x1450, 0x1454, 0x1501, 0x1510, 0x1513, 0x1521, 0x1530,
    0x1532, 0x1551, 0x1620, 0x1624, 0x1627, 0x1644, 0x1646, 0x1701, 0x1703, 0x1710, 0x1712, 0x1721,
    0x1735, 0x1741, 0x1762, 0x1770, 0x2000, 0x2001, 0x2003, 0x2005, 0x2007, 0x2010, 0x2012, 0x2014,
    0x2016, 0x2021, 0x2023, 0x2027, 0x2030, 0x2032, 0x2041, 0x2043, 0x2045, 0x2050, 0x2052, 0x2067,
    0x2070, 0x2073, 0x2075, 0x2100, 0x2102, 0x2110, 0x2113, 0x2117, 0x2122, 0x2125, 0x2131, 0x2134,
    0x2142, 0x2151, 0x2201, 0x2204, 0x2207, 0x2221, 0x2223, 0x2230, 0x2237, 0x2241, 0x2253, 0x2257,
    0x2271, 0x2274, 0x2300, 0x2302, 0x2305, 0x2311, 0x2322, 0x2324, 0x2331, 0x2333, 0x2342, 0x2350,
    0x2366, 0x2401, 0x2407, 0x2420, 0x2423, 0x2432, 0x2435, 0x2441, 0x2472, 0x2475, 0x2504, 0x2511,
    0x2522, 0x2537, 0x2540, 0x2553, 0x2570, 0x2600, 0x2602, 0x2607, 0x2621, 0x2655, 0x2661, 0x2705,
    0x2711, 0x2726, 0x2730, 0x2743, 0x2750, 0x3002, 0x3011, 0x3013, 0x3015, 0x3017, 0x3022, 0x3031,
    0x3033, 0x3035, 0x3042, 0x3044, 0x3047, 0x3051, 0x3063, 0x3071, 0x3101, 0x3103, 0x3105, 0x3114,
    0x3121, 0x3123, 0x3140, 0x3160, 0x3172, 0x3176, 0x3200, 0x3212, 0x3220, 0x3232, 0x3234, 0x3250,
    0x3301, 0x3310, 0x3314, 0x3321, 0x3323, 0x3327, 0x3330, 0x3341, 0x3343, 0x3347, 0x3355, 0x3373,
    0x3403, 0x3411, 0x3416, 0x3422, 0x3431, 0x3452, 0x3460, 0x3464, 0x3501, 0x3510, 0x3512, 0x3525,
    0x3532, 0x3544, 0x3556, 0x3573, 0x3616, 0x3641, 0x3701, 0x3703, 0x3720, 0x3722, 0x3735, 0x4000,
    0x4004, 0x4012, 0x4020, 0x4024, 0x4027, 0x4032, 0x4041, 0x4050, 0x4070, 0x4102, 0x4107, 0x4111,
    0x4113, 0x4122, 0x4130, 0x4135, 0x4143, 0x4151, 0x4155, 0x4201, 0x4203, 0x4210, 0x4215, 0x4221,
    0x4233, 0x4240, 0x4257, 0x4262, 0x4270, 0x4304, 0x4311, 0x4313, 0x4320, 0x4322, 0x4331, 0x4335,
    0x4400, 0x4402, 0x4424, 0x4437, 0x4440, 0x4471, 0x4505, 0x4507, 0x4521, 0x4562, 0x4613, 0x4634,
    0x4660, 0x4710, 0x4715, 0x4730, 0x4743, 0x4751, 0x5002, 0x5010, 0x5014, 0x5022, 0x5040, 0x5044,
    0x5047, 0x5052, 0x5066, 0x5074, 0x5101, 0x5103, 0x5105, 0x5112, 0x5121, 0x5132, 0x5172, 0x5200,
    0x5211, 0x5223, 0x5230, 0x5236, 0x5253, 0x5302, 0x5307, 0x5310, 0x5327, 0x5344, 0x5351, 0x5365,
    0x5373, 0x5401, 0x5404, 0x5420, 0x5432, 0x5446, 0x5512, 0x5526, 0x5551, 0x5553, 0x5642, 0x5702,
    0x5704, 0x5722, 0x6011, 0x6013, 0x6015, 0x6031, 0x6033, 0x6060, 0x6100, 0x6120, 0x6127, 0x6164,
    0x6212, 0x6234, 0x6242, 0x6255, 0x6262, 0x6270, 0x6300, 0x6314, 0x6321, 0x6340, 0x6425, 0x6443,
    0x6462, 0x6500, 0x6503, 0x6534, 0x6560, 0x6605, 0x6640, 0x6711, 0x6713, 0x7000, 0x7004, 0x7007,
    0x7020, 0x7022, 0x7036, 0x7040, 0x7054, 0x7062, 0x7102, 0x7111, 0x7124, 0x7143, 0x7145, 0x7201,
    0x7204, 0x7210, 0x7216, 0x7221, 0x7230, 0x7251, 0x7302, 0x7332, 0x7335, 0x7353, 0x7401, 0x7405,
    0x7413, 0x7420, 0x7450, 0x7522, 0x7542, 0x7602, 0x7631, 0x7700,
};

// Decode staged slice s into 32 floats, with the float32 operations of ggml's reference
// dequantization in its order (the Python twins in quants.py repeat them).
template <int TYPE>
__device__ void decode_slice(const typename BlockFormat<TYPE>::Unit* units, int s, float* out);

template <> __device__ void decode_slice<ES_TYPE_Q4_0>(const unsigned short* units, int, float* out) {
    const float d = half_to_float(units[0]);
#pragma unroll
    for (int j = 0; j < 16; ++j) {
        const int q = (int)block_byte(units, 2 + j);
        out[j] = d * (float)((q & 0xf) - 8);
        out[j + 16] = d * (float)((q >> 4) - 8);
    }
}

template <> __device__ void decode_slice<ES_TYPE_Q4_1>(const unsigned short* units, int, float* out) {
    const float d = half_to_float(units[0]);
    const float m = half_to_float(units[1]);
#pragma unroll
    for (int j = 0; j < 16; ++j) {
        const int q = (int)block_byte(units, 4 + j);
        out[j] = fmaf(d, (float)(q & 0xf), m);
        out[j + 16] = fmaf(d, (float)(q >> 4), m);
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
        out[j] = d * (float)(((q & 0xf) | high_low) - 16);
        out[j + 16] = d * (float)(((q >> 4) | high_high) - 16);
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
        out[j] = fmaf(d, (float)((q & 0xf) | high_low), m);
        out[j + 16] = fmaf(d, (float)((q >> 4) | high_high), m);
    }
}

template <> __device__ void decode_slice<ES_TYPE_Q8_0>(const unsigned short* units, int, float* out) {
    const float d = half_to_float(units[0]);
#pragma unroll
    for (int j = 0; j < 32; ++j) {
        const int q = (int)block_byte(units, 2 + j);
        out[j] = d * (float)(q >= 128 ? q - 256 : q);
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
            out[16 * part + l] = dl * (float)q - ml;
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
            out[e] = dl * (float)(low - (high ? 0 : 4));
        }
    }
}

// Scale and min j (0..7) of Q4_K / Q5_K from their 12 packed bytes at byte 4.
__device__ void k4_scale_min(const unsigned short* units, int j, int* sc, int* m) {
    const int at = 4;
    if (j < 4) {
        *sc = (int)block_byte(units, at + j) & 63;
        *m = (int)block_byte(units, at + j + 4) & 63;
    } else {
        const int high = (int)block_byte(units, at + j + 4);
        *sc = (high & 0xf) | (((int)block_byte(units, at + j - 4) >> 6) << 4);
        *m = (high >> 4) | (((int)block_byte(units, at + j) >> 6) << 4);
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
        out[l] = d * (float)q - dm;
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
        out[l] = d * (float)(low | (high << 4)) - dm;
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
            out[e] = dl * (float)((low | (high << 4)) - 32);
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

// ---------------------------------------------------------------------------------
// Grouping: bucket the (token, slot) pairs by expert and cut each bucket into tiles.
//
// scratch (int32): [0] number of tiles; from MOE_SCRATCH_HEADER, max_tiles triples
// (expert, first row, row count); then n_pairs row entries (pair index t * top_k + k)
// sorted by expert; then, per grouping block, its pairs' count in every bucket. Ids outside
// [0, n_expert) go to bucket n_expert, whose outputs the matrix kernel fills with NaN instead
// of reading memory out of range.
//
// Two launches of one block per MOE_GROUP_CHUNK pairs: moe_group_count counts each block's
// pairs per bucket, moe_group_place works out where each block's pairs of a bucket go (after
// the earlier blocks' pairs of that bucket), writes the tile table (block 0) and places its
// pairs. One block grouping every pair took 43 us for 32768 pairs on an H200 (ubatch 4096),
// whether or not its threads loaded their ids eight at a time; the two launches take 10. The
// order of pairs inside a block's
// share of a bucket depends on atomics; no output value depends on it, because every output
// element is one thread's dot product in a fixed order.
// ---------------------------------------------------------------------------------

#define MOE_GROUP_RUN 8  // pairs whose ids a grouping thread loads at once

__device__ int bucket_of(int id, int n_expert) {
    return (unsigned int)id < (unsigned int)n_expert ? id : n_expert;
}

// This block's count of pairs in every bucket, in the scratch after the row entries.
__device__ int* group_counts(int* scratch, int n_pairs, int max_tiles, int n_buckets, int block) {
    return scratch + MOE_SCRATCH_HEADER + 3 * max_tiles + n_pairs + block * n_buckets;
}

// Every pair of this grouping block advances its bucket's counter by one; with PLACE, the pair's
// index goes to rows where the counter stood. Each thread loads MOE_GROUP_RUN ids before their
// atomics.
template <bool PLACE>
__device__ void group_block_pairs(const int* __restrict__ ids, int n_pairs, int n_expert, int* counter, int* rows) {
    const int begin = blockIdx.x * MOE_GROUP_CHUNK;
    const int end = min(begin + MOE_GROUP_CHUNK, n_pairs);
    for (int first = begin + threadIdx.x; first < end; first += MOE_GROUP_RUN * blockDim.x) {
        int bucket[MOE_GROUP_RUN];
#pragma unroll
        for (int i = 0; i < MOE_GROUP_RUN; ++i) {
            const int p = first + i * (int)blockDim.x;
            bucket[i] = p < end ? bucket_of(ids[p], n_expert) : -1;
        }
#pragma unroll
        for (int i = 0; i < MOE_GROUP_RUN; ++i) {
            if (bucket[i] >= 0) {
                const int at = atomicAdd(&counter[bucket[i]], 1);
                if (PLACE) {
                    rows[at] = first + i * (int)blockDim.x;
                }
            }
        }
    }
}

// a[0..n) becomes its exclusive prefix sums; tmp holds n ints; every thread of the block calls it.
__device__ void block_exclusive_scan(int* a, int* tmp, int n) {
    for (int e = threadIdx.x; e < n; e += blockDim.x) {
        tmp[e] = a[e];
    }
    __syncthreads();
    for (int step = 1; step < n; step *= 2) {  // then tmp[e] sums a over the 2 step elements up to e
        int sum[(MOE_MAX_EXPERTS + MOE_GROUP_THREADS) / MOE_GROUP_THREADS];
        for (int i = 0, e = threadIdx.x; e < n; ++i, e += blockDim.x) {
            sum[i] = tmp[e] + (e >= step ? tmp[e - step] : 0);
        }
        __syncthreads();
        for (int i = 0, e = threadIdx.x; e < n; ++i, e += blockDim.x) {
            tmp[e] = sum[i];
        }
        __syncthreads();
    }
    for (int e = threadIdx.x; e < n; e += blockDim.x) {
        a[e] = tmp[e] - a[e];
    }
    __syncthreads();
}

extern "C" __global__ void __launch_bounds__(MOE_GROUP_THREADS)
    moe_group_count(const int* __restrict__ ids, int* __restrict__ scratch, int n_pairs, int n_expert, int max_tiles) {
    __shared__ int count[MOE_MAX_EXPERTS + 1];
    const int n_buckets = n_expert + 1;
    for (int e = threadIdx.x; e < n_buckets; e += blockDim.x) {
        count[e] = 0;
    }
    __syncthreads();
    group_block_pairs<false>(ids, n_pairs, n_expert, count, 0);
    __syncthreads();
    int* counts = group_counts(scratch, n_pairs, max_tiles, n_buckets, blockIdx.x);
    for (int e = threadIdx.x; e < n_buckets; e += blockDim.x) {
        counts[e] = count[e];
    }
}

extern "C" __global__ void __launch_bounds__(MOE_GROUP_THREADS)
    moe_group_place(const int* __restrict__ ids, int* __restrict__ scratch, int n_pairs, int n_expert, int tile_m,
                    int max_tiles) {
    __shared__ int first_row[MOE_MAX_EXPERTS + 1];   // of each bucket
    __shared__ int first_tile[MOE_MAX_EXPERTS + 1];  // of each bucket
    __shared__ int cursor[MOE_MAX_EXPERTS + 1];      // where this block's next pair of each bucket goes
    __shared__ int tmp[MOE_MAX_EXPERTS + 1];
    const int n_buckets = n_expert + 1;
    int* rows = scratch + MOE_SCRATCH_HEADER + 3 * max_tiles;
    for (int e = threadIdx.x; e < n_buckets; e += blockDim.x) {
        int total = 0;
        int before = 0;  // the earlier blocks' pairs of the bucket
        for (int b = 0; b < (int)gridDim.x; ++b) {
            const int c = group_counts(scratch, n_pairs, max_tiles, n_buckets, b)[e];
            before += b < (int)blockIdx.x ? c : 0;
            total += c;
        }
        first_row[e] = total;
        first_tile[e] = (total + tile_m - 1) / tile_m;
        cursor[e] = before;
    }
    __syncthreads();
    const int last_tiles = first_tile[n_buckets - 1];  // the scans below leave what comes before it
    block_exclusive_scan(first_row, tmp, n_buckets);
    block_exclusive_scan(first_tile, tmp, n_buckets);
    for (int e = threadIdx.x; e < n_buckets; e += blockDim.x) {
        cursor[e] += first_row[e];
    }
    if (blockIdx.x == 0) {
        int* tile_table = scratch + MOE_SCRATCH_HEADER;
        for (int e = threadIdx.x; e < n_buckets; e += blockDim.x) {
            const int count = (e + 1 < n_buckets ? first_row[e + 1] : n_pairs) - first_row[e];
            int t = first_tile[e];
            for (int begin = 0; begin < count; begin += tile_m, ++t) {
                tile_table[3 * t] = e;
                tile_table[3 * t + 1] = first_row[e] + begin;
                tile_table[3 * t + 2] = count - begin < tile_m ? count - begin : tile_m;
            }
        }
        if (threadIdx.x == 0) {
            scratch[0] = first_tile[n_buckets - 1] + last_tiles;
        }
    }
    __syncthreads();
    group_block_pairs<true>(ids, n_pairs, n_expert, cursor, rows);
}

// ---------------------------------------------------------------------------------
// mul_mat_id: y[p, :] = W[expert(p)] @ x[row(p)] for the pairs of one tile.
//
// One block computes TILE_M pairs x MOE_TILE_N outputs; each thread a TM x 8 register
// block (rows i*8 + tm, columns j*16 + tn: the strided layout keeps the 16-byte
// shared-memory reads free of bank conflicts). Per k step the block loads the raw
// weight blocks cooperatively (coalesced), decodes them once into shared memory, and
// loads the activations. Each output is one thread's sum over k in ascending order, so
// results do not depend on the tile a pair lands in.
//
// Quantized rows are read up to the next multiple of MOE_ROW_PADDING elements, as
// ggml's MMQ does: past the last row that is the tensor's padding tail. Activations
// there are zero, so those weights are folded in as 0 * w: zero when the bytes hold
// finite values, NaN when they do not (a dirty tail shows).
// ---------------------------------------------------------------------------------

// What the padded part of one row adds to its dot products: quantized rows are read up to
// the next multiple of MOE_ROW_PADDING elements, as ggml's MMQ reads them, against zero
// activations, so this is 0 * w summed over the tail: zero when the bytes there decode to
// finite values, NaN when they do not (a dirty tail shows). Zero for the float types.
template <int TYPE>
__device__ float padding_tail(const unsigned char* __restrict__ row, int n_in) {
    typedef typename BlockFormat<TYPE>::Unit Unit;
    const int UNITS = BlockFormat<TYPE>::slice_units;
    const int SLICES = BlockFormat<TYPE>::slices;
    float tail_sum = 0.0f;
    if (!BlockFormat<TYPE>::quantized) {
        return tail_sum;
    }
    const int padded_steps = (n_in + MOE_ROW_PADDING - 1) / MOE_ROW_PADDING * (MOE_ROW_PADDING / MOE_TILE_K);
    for (int ks = n_in / MOE_TILE_K; ks < padded_steps; ++ks) {
        const Unit* block = (const Unit*)(row + (long long)(ks / SLICES) * BlockFormat<TYPE>::bytes);
        Unit staged[UNITS];
#pragma unroll
        for (int h = 0; h < UNITS; ++h) {
            staged[h] = block[BlockFormat<TYPE>::unit_of(ks % SLICES, h)];
        }
        float v[32];
        decode_slice<TYPE>(staged, ks % SLICES, v);
#pragma unroll
        for (int j = 0; j < 32; ++j) {
            tail_sum += 0.0f * v[j];
        }
    }
    return tail_sum;
}

// The start of every mul_mat_id block: the tile of blockIdx.y from the grouping scratch,
// its pairs' output rows (dst_row; -1 past the tile's count) and activation rows (src_row)
// staged in shared memory. Returns the tile's expert, or -1 when the block has nothing more
// to do: no tile (the grid is sized for the most tiles there can be), or the bucket of
// out-of-range ids, whose outputs it fills with NaN. Either way the whole block returns.
template <int TILE_M, int THREADS>
__device__ int begin_tile(const int* __restrict__ scratch, float* __restrict__ y, int* src_row, int* dst_row,
                          int n_expert, int n_out, int top_k, int x_per_slot, int max_tiles) {
    const int tile = blockIdx.y;
    if (tile >= scratch[0]) {
        return -1;
    }
    const int* entry = scratch + MOE_SCRATCH_HEADER + 3 * tile;
    const int expert = entry[0];
    const int first = entry[1];
    const int count = entry[2];
    const int* rows = scratch + MOE_SCRATCH_HEADER + 3 * max_tiles;
    const int tid = threadIdx.x;
    for (int m = tid; m < TILE_M; m += THREADS) {
        const int p = m < count ? rows[first + m] : -1;
        dst_row[m] = p;
        src_row[m] = p < 0 ? -1 : (x_per_slot ? p : p / top_k);
    }
    __syncthreads();
    if (expert == n_expert) {
        const int n0 = blockIdx.x * MOE_TILE_N;
        for (int i = tid; i < count * MOE_TILE_N; i += THREADS) {
            const int o = n0 + i % MOE_TILE_N;
            if (o < n_out) {
                y[(long long)dst_row[i / MOE_TILE_N] * n_out + o] = bits_to_float(0x7fc00000u);
            }
        }
        return -1;
    }
    return expert;
}

// Bytes of one weight row of n_in elements.
template <int TYPE>
__device__ long long weight_row_bytes(int n_in) {
    return BlockFormat<TYPE>::quantized
               ? (long long)(n_in / (MOE_TILE_K * BlockFormat<TYPE>::slices)) * BlockFormat<TYPE>::bytes
               : (long long)n_in * (BlockFormat<TYPE>::bytes / MOE_TILE_K);
}

template <int TYPE, int TILE_M>
__device__ void mul_mat_id_tile(const unsigned char* __restrict__ w, const float* __restrict__ x,
                                const int* __restrict__ scratch, float* __restrict__ y, int n_expert,
                                int n_out, int n_in, int top_k, int x_per_slot, int max_tiles) {
    typedef typename BlockFormat<TYPE>::Unit Unit;
    const int UNITS = BlockFormat<TYPE>::slice_units;
    const int SLICES = BlockFormat<TYPE>::slices;
    const int BLOCK_BYTES = BlockFormat<TYPE>::bytes;
    const int ROW_WORDS = (UNITS * (int)sizeof(Unit) + 3) / 4;
    const int RAW_STRIDE = (ROW_WORDS | 1) * 4 / (int)sizeof(Unit);  // odd words per row: no bank conflicts
    const int TM = TILE_M / 8;
    const int LDS = MOE_TILE_K + 4;  // floats per shared row; keeps rows 16-byte aligned

    __shared__ vec4 x_tile[TILE_M][LDS / 4];
    __shared__ vec4 w_tile[MOE_TILE_N][LDS / 4];
    __shared__ Unit raw[MOE_TILE_N * RAW_STRIDE];
    __shared__ int src_row[TILE_M];
    __shared__ int dst_row[TILE_M];
    __shared__ float tail[MOE_TILE_N];

    const int expert = begin_tile<TILE_M, MOE_MMID_THREADS>(scratch, y, src_row, dst_row, n_expert, n_out, top_k,
                                                             x_per_slot, max_tiles);
    if (expert < 0) {
        return;
    }
    const int tid = threadIdx.x;
    const int n0 = blockIdx.x * MOE_TILE_N;
    const long long row_bytes = weight_row_bytes<TYPE>(n_in);
    const unsigned char* w_expert = w + (long long)expert * n_out * row_bytes;
    const int expert_row_bytes = (int)row_bytes;
    const int k_steps = (n_in + MOE_TILE_K - 1) / MOE_TILE_K;

    // The padded part of quantized rows: thread tid reads row n0 + tid directly.
    const float tail_sum =
        n0 + tid < n_out ? padding_tail<TYPE>(w_expert + (long long)(n0 + tid) * row_bytes, n_in) : 0.0f;
    tail[tid] = tail_sum;  // read after the k loop, whose barriers order it

    const int tm = tid / 16;
    const int tn = tid % 16;
    float acc[TM][8];
#pragma unroll
    for (int i = 0; i < TM; ++i) {
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            acc[i][j] = 0.0f;
        }
    }

    // One k step's global data, staged in registers: thread tid holds staged unit
    // tid + r * MOE_MMID_THREADS of the raw weight tile (consecutive threads read
    // consecutive units of a row: coalesced) and activation row tid / 32 + r * 4, column
    // tid % 32. For the float types unit h is element k0 + h.
    const int X_PER_THREAD = TILE_M * MOE_TILE_K / MOE_MMID_THREADS;
    Unit raw_regs[UNITS];
    float x_regs[X_PER_THREAD];
    auto load_step = [&](int ks) {
        const int k0 = ks * MOE_TILE_K;
#pragma unroll
        for (int r = 0; r < UNITS; ++r) {
            const int i = tid + r * MOE_MMID_THREADS;
            const int n = i / UNITS;
            const int h = i - n * UNITS;
            Unit v = 0;
            if (n0 + n < n_out && (BlockFormat<TYPE>::quantized || k0 + h < n_in)) {
                // 32-bit offsets inside one expert (the launcher checks they fit): fewer registers.
                const int offset = (n0 + n) * expert_row_bytes + (ks / SLICES) * BLOCK_BYTES;
                v = ((const Unit*)(w_expert + offset))[BlockFormat<TYPE>::unit_of(ks % SLICES, h)];
            }
            raw_regs[r] = v;
        }
#pragma unroll
        for (int r = 0; r < X_PER_THREAD; ++r) {
            const int src = src_row[tid / MOE_TILE_K + r * (MOE_MMID_THREADS / MOE_TILE_K)];
            const int k = k0 + tid % MOE_TILE_K;
            x_regs[r] = (src >= 0 && k < n_in) ? x[(long long)src * n_in + k] : 0.0f;
        }
    };
    auto store_step = [&]() {
#pragma unroll
        for (int r = 0; r < UNITS; ++r) {
            const int i = tid + r * MOE_MMID_THREADS;
            const int n = i / UNITS;
            raw[n * RAW_STRIDE + i - n * UNITS] = raw_regs[r];
        }
#pragma unroll
        for (int r = 0; r < X_PER_THREAD; ++r) {
            const int m = tid / MOE_TILE_K + r * (MOE_MMID_THREADS / MOE_TILE_K);
            ((float*)x_tile[m])[tid % MOE_TILE_K] = x_regs[r];
        }
    };

    for (int ks = 0; ks < k_steps; ++ks) {
        // All loads of a step are issued before the first store. Loading the next step
        // during this one's compute measured no faster on the H200: the extra registers
        // cost more occupancy than the overlap gained.
        load_step(ks);
        store_step();
        __syncthreads();
        {
            float v[32];
            decode_slice<TYPE>(raw + tid * RAW_STRIDE, ks % SLICES, v);
#pragma unroll
            for (int q = 0; q < 8; ++q) {
                vec4 packed;
                packed.x = v[4 * q];
                packed.y = v[4 * q + 1];
                packed.z = v[4 * q + 2];
                packed.w = v[4 * q + 3];
                w_tile[tid][q] = packed;
            }
        }
        __syncthreads();
        // Not unrolled: full unrolling lets the compiler hoist shared loads into up to 255
        // registers, which costs more in occupancy than it gains (measured on the H200).
#pragma unroll 1
        for (int kq = 0; kq < MOE_TILE_K / 4; ++kq) {
            vec4 a[TM];
#pragma unroll
            for (int i = 0; i < TM; ++i) {
                a[i] = x_tile[i * 8 + tm][kq];
            }
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                const vec4 b = w_tile[j * 16 + tn][kq];
#pragma unroll
                for (int i = 0; i < TM; ++i) {
                    acc[i][j] = fmaf(a[i].x, b.x, acc[i][j]);
                    acc[i][j] = fmaf(a[i].y, b.y, acc[i][j]);
                    acc[i][j] = fmaf(a[i].z, b.z, acc[i][j]);
                    acc[i][j] = fmaf(a[i].w, b.w, acc[i][j]);
                }
            }
        }
        __syncthreads();
    }


#pragma unroll
    for (int i = 0; i < TM; ++i) {
        const int p = dst_row[i * 8 + tm];
        if (p < 0) {
            continue;
        }
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            const int o = n0 + j * 16 + tn;
            if (o < n_out) {
                y[(long long)p * n_out + o] = acc[i][j] + tail[j * 16 + tn];
            }
        }
    }
}

#define MOE_MUL_MAT_ID(NAME, TYPE, TILE_M)                                                                \
    extern "C" __global__ void __launch_bounds__(MOE_MMID_THREADS)                                      \
        NAME(const unsigned char* __restrict__ w, const float* __restrict__ x,                         \
             const int* __restrict__ scratch, float* __restrict__ y, int n_expert, int n_out, int n_in, \
             int top_k, int x_per_slot, int max_tiles) {                                                \
        mul_mat_id_tile<TYPE, TILE_M>(w, x, scratch, y, n_expert, n_out, n_in, top_k, x_per_slot,      \
                                      max_tiles);                                                       \
    }
// Instances (one per weight type and tile height of layout.FORMATS) are appended by
// kernels.kernel_source, for the types a module needs.


// ---------------------------------------------------------------------------------
// Elementwise and reduction kernels.
// ---------------------------------------------------------------------------------

extern "C" __global__ void moe_swiglu(const float* __restrict__ gate, const float* __restrict__ up,
                                      float* __restrict__ out, int n) {
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        const float g = gate[i];
        out[i] = g / (1.0f + expf(-g)) * up[i];
    }
}

// The end of an MoE layer: hidden[t, i] += sum over k = 0..top_k-1, in that order, of
// weights[t, k] * y[t, k, i] (fused multiply-adds), or of y[t, k, i] where weights is null
// (rows the routing weights already scale), plus extra[t, i] (a shared expert's output) where
// extra is not null.
extern "C" __global__ void moe_combine(const float* __restrict__ y, const float* __restrict__ weights,
                                       const float* __restrict__ extra, float* __restrict__ hidden, int n_tokens,
                                       int top_k, int n) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) {
        return;
    }
    for (int t = blockIdx.y; t < n_tokens; t += gridDim.y) {
        float acc = 0.0f;
        for (int k = 0; k < top_k; ++k) {
            const float v = y[((long long)t * top_k + k) * n + i];
            acc = weights ? fmaf(weights[t * top_k + k], v, acc) : acc + v;
        }
        if (extra) {
            acc += extra[(long long)t * n + i];
        }
        hidden[(long long)t * n + i] += acc;
    }
}

// Total order for top-k: a larger logit wins, equal logits go to the lower id, NaN loses
// to any number; an empty candidate (id < 0) never wins.
__device__ bool router_better(float v, int e, float best_v, int best_e) {
    if (e < 0) {
        return false;
    }
    if (best_e < 0) {
        return true;
    }
    const bool v_nan = v != v;
    const bool best_nan = best_v != best_v;
    if (v_nan != best_nan) {
        return best_nan;
    }
    if (v_nan) {
        return e < best_e;
    }
    return v > best_v || (v == best_v && e < best_e);
}

// logits = x @ router^T; ids = the top_k experts by logit; weights = softmax over the
// selected logits. One block handles ROUTER_TOKENS tokens, 32 threads per token.
extern "C" __global__ void __launch_bounds__(ROUTER_THREADS) moe_router_topk(
    const float* __restrict__ x, const float* __restrict__ router, int* __restrict__ ids,
    float* __restrict__ weights, int n_tokens, int n_embd, int n_expert, int top_k) {
    __shared__ float logits[ROUTER_TOKENS][ROUTER_MAX_EXPERTS];
    __shared__ unsigned char taken[ROUTER_TOKENS][ROUTER_MAX_EXPERTS];
    __shared__ float x_chunk[ROUTER_TOKENS][33];
    __shared__ float r_chunk[ROUTER_EXPERT_CHUNK][33];
    __shared__ float cand_v[ROUTER_THREADS];
    __shared__ int cand_e[ROUTER_THREADS];
    __shared__ float sel_v[ROUTER_TOKENS][ROUTER_MAX_K];
    __shared__ int sel_e[ROUTER_TOKENS][ROUTER_MAX_K];

    const int tid = threadIdx.x;
    const int group = tid / 32;
    const int lane = tid % 32;
    const int t = blockIdx.x * ROUTER_TOKENS + group;

    for (int e0 = 0; e0 < n_expert; e0 += ROUTER_EXPERT_CHUNK) {
        float acc0 = 0.0f;
        float acc1 = 0.0f;
        for (int k0 = 0; k0 < n_embd; k0 += 32) {
            const bool x_inside = t < n_tokens && k0 + lane < n_embd;
            x_chunk[group][lane] = x_inside ? x[(long long)t * n_embd + k0 + lane] : 0.0f;
            for (int i = tid; i < ROUTER_EXPERT_CHUNK * 32; i += ROUTER_THREADS) {
                const int e = e0 + i / 32;
                const int k = k0 + i % 32;
                const bool r_inside = e < n_expert && k < n_embd;
                r_chunk[i / 32][i % 32] = r_inside ? router[(long long)e * n_embd + k] : 0.0f;
            }
            __syncthreads();
#pragma unroll
            for (int k = 0; k < 32; ++k) {
                acc0 = fmaf(x_chunk[group][k], r_chunk[lane][k], acc0);
                acc1 = fmaf(x_chunk[group][k], r_chunk[lane + 32][k], acc1);
            }
            __syncthreads();
        }
        if (e0 + lane < n_expert) {
            logits[group][e0 + lane] = acc0;
            taken[group][e0 + lane] = 0;
        }
        if (e0 + lane + 32 < n_expert) {
            logits[group][e0 + lane + 32] = acc1;
            taken[group][e0 + lane + 32] = 0;
        }
    }
    __syncthreads();

    for (int j = 0; j < top_k; ++j) {
        float best_v = 0.0f;
        int best_e = -1;
        for (int e = lane; e < n_expert; e += 32) {
            if (!taken[group][e] && router_better(logits[group][e], e, best_v, best_e)) {
                best_v = logits[group][e];
                best_e = e;
            }
        }
        cand_v[tid] = best_v;
        cand_e[tid] = best_e;
        __syncthreads();
        for (int s = 16; s > 0; s >>= 1) {
            if (lane < s && router_better(cand_v[tid + s], cand_e[tid + s], cand_v[tid], cand_e[tid])) {
                cand_v[tid] = cand_v[tid + s];
                cand_e[tid] = cand_e[tid + s];
            }
            __syncthreads();
        }
        if (lane == 0) {
            sel_v[group][j] = cand_v[tid];
            sel_e[group][j] = cand_e[tid];
            taken[group][cand_e[tid]] = 1;
        }
        __syncthreads();
    }

    if (lane == 0 && t < n_tokens) {
        const float max_v = sel_v[group][0];  // the selection order puts the largest first
        float sum = 0.0f;
        for (int j = 0; j < top_k; ++j) {
            sum += expf(sel_v[group][j] - max_v);
        }
        for (int j = 0; j < top_k; ++j) {
            ids[(long long)t * top_k + j] = sel_e[group][j];
            weights[(long long)t * top_k + j] = expf(sel_v[group][j] - max_v) / sum;
        }
    }
}

// ---------------------------------------------------------------------------------
// Stand-ins the prefill runner puts around the MoE block: a weightless RMS norm in
// place of attention and normalization, and the residual add.
// ---------------------------------------------------------------------------------

// x[t, :] = h[t, :] / sqrt(mean(h[t, :]^2) + 1e-6). One block per token; blockDim.x must be
// a power of two and the launch must give blockDim.x floats of dynamic shared memory. The
// reduction runs in a fixed order, so the result never depends on timing.
extern "C" __global__ void moe_rms_norm(const float* __restrict__ h, float* __restrict__ x, int n_tokens, int n) {
    extern __shared__ float partial[];
    const int t = blockIdx.x;
    if (t >= n_tokens) {
        return;  // the whole block returns: no thread is left waiting at a barrier
    }
    const float* row = h + (long long)t * n;
    float sum = 0.0f;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        sum = fmaf(row[i], row[i], sum);
    }
    partial[threadIdx.x] = sum;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) {
            partial[threadIdx.x] += partial[threadIdx.x + s];
        }
        __syncthreads();
    }
    const float scale = 1.0f / sqrtf(partial[0] / (float)n + 1e-6f);
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        x[(long long)t * n + i] = row[i] * scale;
    }
}

// h[i] += delta[i] for i < n.
extern "C" __global__ void moe_add_inplace(float* __restrict__ h, const float* __restrict__ delta, int n) {
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        h[i] += delta[i];
    }
}

// ---------------------------------------------------------------------------------
// Routing and expert FFN pieces per architecture (see kernels/routing.py): router
// logits with an optional bias, gated top-k selection (softmax, sigmoid or softmax
// after selection; a selection-only bias; group-limited selection; normalization
// and scale of the weights), the clamped SwiGLU of gpt-oss, per-expert output
// biases, and the sigmoid gate of a shared expert.
// ---------------------------------------------------------------------------------

#define GATING_SOFTMAX 1          // llama.cpp's expert_gating_func values
#define GATING_SIGMOID 2
#define GATING_SOFTMAX_WEIGHT 3
#define SELECT_THREADS 128        // one block per token in router_select
#define SELECT_MAX_GROUPS 64
#define LOGITS_TOKENS 8           // logits tile: LOGITS_TOKENS tokens x 32 experts
#define WEIGHTS_SUM_MIN 6.103515625e-5f  // floor of the sum that normalized weights divide by
#define NEG_INFINITY bits_to_float(0xff800000u)

// logits[t, e] = x[t, :] . router[e, :] (+ bias[e] when has_bias), accumulated in k order.
extern "C" __global__ void __launch_bounds__(LOGITS_TOKENS * 32) moe_router_logits(
    const float* __restrict__ x, const float* __restrict__ router, const float* __restrict__ bias,
    float* __restrict__ logits, int n_tokens, int n_embd, int n_expert, int has_bias) {
    __shared__ float x_tile[LOGITS_TOKENS][33];
    __shared__ float r_tile[32][33];
    const int lane = threadIdx.x % 32;
    const int row = threadIdx.x / 32;
    const int e = blockIdx.x * 32 + lane;
    const int t = blockIdx.y * LOGITS_TOKENS + row;
    float acc = 0.0f;
    for (int k0 = 0; k0 < n_embd; k0 += 32) {
        x_tile[row][lane] = (t < n_tokens && k0 + lane < n_embd) ? x[(long long)t * n_embd + k0 + lane] : 0.0f;
        for (int i = threadIdx.x; i < 32 * 32; i += LOGITS_TOKENS * 32) {
            const int re = blockIdx.x * 32 + i / 32;
            const int rk = k0 + i % 32;
            r_tile[i / 32][i % 32] = (re < n_expert && rk < n_embd) ? router[(long long)re * n_embd + rk] : 0.0f;
        }
        __syncthreads();
        const int k_end = min(32, n_embd - k0);
        for (int k = 0; k < k_end; ++k) {
            acc = fmaf(x_tile[row][k], r_tile[lane][k], acc);
        }
        __syncthreads();
    }
    if (t < n_tokens && e < n_expert) {
        logits[(long long)t * n_expert + e] = has_bias ? acc + bias[e] : acc;
    }
}

// Block-wide best (value, id) by router_better; every thread gets the winner.
__device__ void select_block_best(float* cand_v, int* cand_e, float v, int e, float* out_v, int* out_e) {
    const int tid = threadIdx.x;
    cand_v[tid] = v;
    cand_e[tid] = e;
    __syncthreads();
    for (int s = SELECT_THREADS / 2; s > 0; s >>= 1) {
        if (tid < s && router_better(cand_v[tid + s], cand_e[tid + s], cand_v[tid], cand_e[tid])) {
            cand_v[tid] = cand_v[tid + s];
            cand_e[tid] = cand_e[tid + s];
        }
        __syncthreads();
    }
    *out_v = cand_v[0];
    *out_e = cand_e[0];
    __syncthreads();
}

// Per token: probs = gating(logits); selection = probs (+ sel_bias); with n_group > 1,
// only the n_group_used groups with the largest sum of their two best selection values
// stay selectable; ids = top_k by selection (descending, ties to the lower id);
// weights = probs[ids], softmaxed for GATING_SOFTMAX_WEIGHT, divided by their sum
// (floored) when norm, times scale. One block of SELECT_THREADS per token.
extern "C" __global__ void __launch_bounds__(SELECT_THREADS) moe_router_select(
    const float* __restrict__ logits, const float* __restrict__ sel_bias, int* __restrict__ ids,
    float* __restrict__ weights, int n_tokens, int n_expert, int top_k, int gating, int has_sel_bias,
    int n_group, int n_group_used, int norm, float scale) {
    __shared__ float probs[ROUTER_MAX_EXPERTS];
    __shared__ float sel[ROUTER_MAX_EXPERTS];
    __shared__ unsigned char taken[ROUTER_MAX_EXPERTS];
    __shared__ float group_score[SELECT_MAX_GROUPS];
    __shared__ unsigned char group_kept[SELECT_MAX_GROUPS];
    __shared__ float cand_v[SELECT_THREADS];
    __shared__ int cand_e[SELECT_THREADS];
    __shared__ int chosen[ROUTER_MAX_K];
    const int t = blockIdx.x;
    if (t >= n_tokens) {
        return;  // the whole block returns together
    }
    const int tid = threadIdx.x;
    const float* row = logits + (long long)t * n_expert;

    float local_max = NEG_INFINITY;
    for (int e = tid; e < n_expert; e += SELECT_THREADS) {
        probs[e] = row[e];
        local_max = fmaxf(local_max, row[e]);
        taken[e] = 0;
    }
    if (gating == GATING_SOFTMAX) {
        float max_v;
        int unused;
        select_block_best(cand_v, cand_e, local_max, tid, &max_v, &unused);
        float local_sum = 0.0f;
        for (int e = tid; e < n_expert; e += SELECT_THREADS) {
            probs[e] = expf(probs[e] - max_v);
            local_sum += probs[e];
        }
        cand_v[tid] = local_sum;
        __syncthreads();
        for (int s = SELECT_THREADS / 2; s > 0; s >>= 1) {
            if (tid < s) {
                cand_v[tid] += cand_v[tid + s];
            }
            __syncthreads();
        }
        const float sum = cand_v[0];
        __syncthreads();
        for (int e = tid; e < n_expert; e += SELECT_THREADS) {
            probs[e] = probs[e] / sum;
        }
    } else if (gating == GATING_SIGMOID) {
        for (int e = tid; e < n_expert; e += SELECT_THREADS) {
            probs[e] = 1.0f / (1.0f + expf(-probs[e]));
        }
    }
    __syncthreads();
    for (int e = tid; e < n_expert; e += SELECT_THREADS) {
        sel[e] = has_sel_bias ? probs[e] + sel_bias[e] : probs[e];
    }
    __syncthreads();

    if (n_group > 1) {
        const int per_group = n_expert / n_group;
        if (tid < n_group) {
            float first = NEG_INFINITY;
            float second = NEG_INFINITY;
            for (int e = tid * per_group; e < (tid + 1) * per_group; ++e) {
                if (sel[e] > first) {
                    second = first;
                    first = sel[e];
                } else if (sel[e] > second) {
                    second = sel[e];
                }
            }
            group_score[tid] = first + second;
            group_kept[tid] = 0;
        }
        __syncthreads();
        if (tid == 0) {
            for (int j = 0; j < n_group_used; ++j) {
                int best = -1;
                for (int g = 0; g < n_group; ++g) {
                    if (!group_kept[g] && router_better(group_score[g], g, best < 0 ? 0.0f : group_score[best], best)) {
                        best = g;
                    }
                }
                group_kept[best] = 1;
            }
        }
        __syncthreads();
        for (int e = tid; e < n_expert; e += SELECT_THREADS) {
            if (!group_kept[e / per_group]) {
                sel[e] = NEG_INFINITY;
            }
        }
        __syncthreads();
    }

    for (int j = 0; j < top_k; ++j) {
        float best_v = 0.0f;
        int best_e = -1;
        for (int e = tid; e < n_expert; e += SELECT_THREADS) {
            if (!taken[e] && router_better(sel[e], e, best_v, best_e)) {
                best_v = sel[e];
                best_e = e;
            }
        }
        float win_v;
        int win_e;
        select_block_best(cand_v, cand_e, best_v, best_e, &win_v, &win_e);
        if (tid == 0) {
            chosen[j] = win_e;
            taken[win_e] = 1;
        }
        __syncthreads();
    }

    if (tid == 0) {
        float w[ROUTER_MAX_K];
        for (int j = 0; j < top_k; ++j) {
            w[j] = probs[chosen[j]];
        }
        if (gating == GATING_SOFTMAX_WEIGHT) {
            float max_w = w[0];
            for (int j = 1; j < top_k; ++j) {
                max_w = fmaxf(max_w, w[j]);
            }
            float sum = 0.0f;
            for (int j = 0; j < top_k; ++j) {
                w[j] = expf(w[j] - max_w);
                sum += w[j];
            }
            for (int j = 0; j < top_k; ++j) {
                w[j] = w[j] / sum;
            }
        }
        if (norm) {
            float sum = 0.0f;
            for (int j = 0; j < top_k; ++j) {
                sum += w[j];
            }
            sum = fmaxf(sum, WEIGHTS_SUM_MIN);
            for (int j = 0; j < top_k; ++j) {
                w[j] = w[j] / sum;
            }
        }
        for (int j = 0; j < top_k; ++j) {
            ids[(long long)t * top_k + j] = chosen[j];
            weights[(long long)t * top_k + j] = w[j] * scale;
        }
    }
}

// gpt-oss's SwiGLU: g = min(gate, limit), u = clamp(up, -limit, limit),
// out = g / (1 + exp(-alpha g)) * (u + 1).
extern "C" __global__ void moe_swiglu_oai(const float* __restrict__ gate, const float* __restrict__ up,
                                          float* __restrict__ out, int n, float alpha, float limit) {
    const long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += stride) {
        const float g = fminf(gate[i], limit);
        const float u = fminf(fmaxf(up[i], -limit), limit);
        out[i] = g / (1.0f + expf(-alpha * g)) * (u + 1.0f);
    }
}

// y[p, i] += bias[ids[p], i] for every (token, slot) pair p; pairs with an id outside
// [0, n_expert) are left as they are (mul_mat_id made them NaN).
extern "C" __global__ void moe_add_expert_bias(float* __restrict__ y, const float* __restrict__ bias,
                                               const int* __restrict__ ids, int n_pairs, int n_out,
                                               int n_expert) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n_out) {
        return;
    }
    for (int p = blockIdx.y; p < n_pairs; p += gridDim.y) {
        const int e = ids[p];
        if (e >= 0 && e < n_expert) {
            y[(long long)p * n_out + i] += bias[(long long)e * n_out + i];
        }
    }
}

// y[t, :] *= sigmoid(x[t, :] . w) for a shared expert's output y [n_tokens, n]. One
// block per token; blockDim.x must be a power of two with that many floats of dynamic
// shared memory.
extern "C" __global__ void moe_shared_gate(const float* __restrict__ x, const float* __restrict__ w,
                                           float* __restrict__ y, int n_tokens, int n_embd, int n) {
    extern __shared__ float partial[];
    const int t = blockIdx.x;
    if (t >= n_tokens) {
        return;
    }
    float sum = 0.0f;
    for (int i = threadIdx.x; i < n_embd; i += blockDim.x) {
        sum = fmaf(x[(long long)t * n_embd + i], w[i], sum);
    }
    partial[threadIdx.x] = sum;
    __syncthreads();
    for (int s = blockDim.x / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) {
            partial[threadIdx.x] += partial[threadIdx.x + s];
        }
        __syncthreads();
    }
    const float gate = 1.0f / (1.0f + expf(-partial[0]));
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        y[(long long)t * n + i] *= gate;
    }
}
