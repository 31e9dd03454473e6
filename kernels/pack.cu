// Gather (pack) many small or strided device tensors into one buffer, and
// scatter (unpack) them back, in one launch each. Built ahead of time by
// kernels/build.py (cubins per architecture, PTX for compute_70) into
// kernels/bin/, embedded by src/cuda/kernels.rs; NVRTC at run time is only
// the fallback. The CPU reference, and so the spec, is
// pinshm::copy::pack_cpu / unpack_cpu.
//
// Grid: blockIdx.y walks the pieces; within a piece the rows are walked by
// the whole x-grid (few rows), by one block per row (long rows) or by one
// warp per row (short rows), with no division per element. Each row moves
// in the widest words (16, 8 or 4 bytes) its device and packed addresses
// allow, after a byte head that aligns them and before a byte tail.
//
// Descriptors travel by value as a kernel parameter (`inl`: up to
// PINSHM_INLINE_DESCS of them, 3,840 bytes, inside the 4 KiB parameter
// limit of every architecture). More pieces take several launches on the
// same stream: no device table, hence no cuMemAlloc/cuMemFree per launch
// and no pageable upload (which the driver may stage with a stream sync).

#define PINSHM_INLINE_DESCS 96

struct PackDesc {
    unsigned long long device_ptr;  // first row on the device
    unsigned long long offset;      // where the piece starts in the packed buffer
    unsigned long long rows;
    unsigned long long row_bytes;
    unsigned long long pitch;       // distance between row starts on the device
};

struct InlineDescs {
    PackDesc d[PINSHM_INLINE_DESCS];
};

// Moves one row of `n` bytes between `dev` and `pk`, as thread `t` of `nt`.
template <typename T>
__device__ __forceinline__ void move_row(unsigned char* dev, unsigned char* pk,
                                         unsigned long long n, unsigned long long t,
                                         unsigned long long nt, bool to_packed) {
    const unsigned long long w = sizeof(T);
    unsigned long long head = (w - ((unsigned long long)dev & (w - 1))) & (w - 1);
    if (head > n) head = n;
    const unsigned long long words = (n - head) / w;  // a shift: w is a power of two
    const unsigned long long tail_at = head + words * w;
    const unsigned long long tail = n - tail_at;
    if (t < head) {
        if (to_packed) pk[t] = dev[t]; else dev[t] = pk[t];
    }
    T* dw = (T*)(dev + head);
    T* pw = (T*)(pk + head);
    for (unsigned long long k = t; k < words; k += nt) {
        if (to_packed) pw[k] = dw[k]; else dw[k] = pw[k];
    }
    if (t < tail) {
        const unsigned long long i = tail_at + t;
        if (to_packed) pk[i] = dev[i]; else dev[i] = pk[i];
    }
}

// Walks the rows of one piece with words of type T.
template <typename T>
__device__ void move_piece(const PackDesc& p, unsigned char* packed, bool to_packed) {
    unsigned char* dev0 = (unsigned char*)p.device_ptr;
    unsigned char* pk0 = packed + p.offset;
    unsigned long long rows = p.rows, row_bytes = p.row_bytes, pitch = p.pitch;
    if (rows > 1 && pitch == row_bytes) {  // dense rows: one long row
        row_bytes *= rows;
        rows = 1;
        pitch = row_bytes;
    }
    const unsigned long long bx = blockIdx.x, gx = gridDim.x, tx = threadIdx.x, bd = blockDim.x;
    const unsigned long long row_words = row_bytes / sizeof(T);
    if (rows < gx) {
        // Few rows: the whole x-grid moves each row in turn.
        for (unsigned long long r = 0; r < rows; ++r) {
            move_row<T>(dev0 + r * pitch, pk0 + r * row_bytes, row_bytes, bx * bd + tx, gx * bd, to_packed);
        }
    } else if (row_words >= 2 * 32) {
        // Many long rows: one block per row.
        for (unsigned long long r = bx; r < rows; r += gx) {
            move_row<T>(dev0 + r * pitch, pk0 + r * row_bytes, row_bytes, tx, bd, to_packed);
        }
    } else {
        // Many short rows: one warp per row.
        const unsigned long long lane = tx & 31, warps = bd >> 5;
        for (unsigned long long r = bx * warps + (tx >> 5); r < rows; r += gx * warps) {
            move_row<T>(dev0 + r * pitch, pk0 + r * row_bytes, row_bytes, lane, 32, to_packed);
        }
    }
}

__device__ void move_all(unsigned int n, unsigned char* packed, const InlineDescs& inl,
                         bool to_packed) {
    for (unsigned int d = blockIdx.y; d < n; d += gridDim.y) {
        const PackDesc p = inl.d[d];
        if (p.rows == 0 || p.row_bytes == 0) continue;
        // Words of width w need the device and packed addresses to agree
        // modulo w in every row: the same start alignment, and a pitch that
        // moves both sides by the same amount modulo w.
        const unsigned long long dev = p.device_ptr, pk = (unsigned long long)packed + p.offset;
        const unsigned long long skew = (dev ^ pk) | (p.rows > 1 ? (p.pitch - p.row_bytes) : 0);
        if ((skew & 15) == 0) {
            move_piece<uint4>(p, packed, to_packed);
        } else if ((skew & 7) == 0) {
            move_piece<unsigned long long>(p, packed, to_packed);
        } else if ((skew & 3) == 0) {
            move_piece<unsigned int>(p, packed, to_packed);
        } else {
            move_piece<unsigned char>(p, packed, to_packed);
        }
    }
}

extern "C" __global__ void pinshm_pack(unsigned int n, unsigned char* packed, InlineDescs inl) {
    move_all(n, packed, inl, true);
}

extern "C" __global__ void pinshm_unpack(unsigned int n, unsigned char* packed, InlineDescs inl) {
    move_all(n, packed, inl, false);
}
