// Gather (pack) many small or strided device tensors into one buffer, and
// scatter (unpack) them back, in one launch each. Compiled at run time with
// NVRTC (see src/cuda.rs); the CPU reference is pinshm::copy::pack_cpu.
//
// Grid: blockIdx.y walks the pieces, blockIdx.x/threadIdx.x the bytes of a
// piece. A piece whose addresses, row length and pitch are all multiples of
// 16 bytes moves 16 bytes per thread; others move bytes.

struct PackDesc {
    unsigned long long device_ptr;  // first row on the device
    unsigned long long offset;      // where the piece starts in the packed buffer
    unsigned long long rows;
    unsigned long long row_bytes;
    unsigned long long pitch;       // distance between row starts on the device
};

template <typename T>
__device__ void move_piece(const PackDesc& p, unsigned char* packed, bool to_packed) {
    const unsigned long long w = sizeof(T);
    const unsigned long long row_words = p.row_bytes / w;
    const unsigned long long total = p.rows * row_words;
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long k = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; k < total; k += stride) {
        const unsigned long long r = k / row_words;
        const unsigned long long c = k - r * row_words;
        T* dev = (T*)(p.device_ptr + r * p.pitch) + c;
        T* pk = (T*)(packed + p.offset) + k;
        if (to_packed) {
            *pk = *dev;
        } else {
            *dev = *pk;
        }
    }
}

__device__ void move_all(const PackDesc* descs, unsigned int n, unsigned char* packed, bool to_packed) {
    for (unsigned int d = blockIdx.y; d < n; d += gridDim.y) {
        const PackDesc p = descs[d];
        if (p.rows == 0 || p.row_bytes == 0) continue;
        const unsigned long long a = p.device_ptr | p.offset | p.row_bytes | p.pitch
            | (unsigned long long)packed;
        if ((a & 15) == 0) {
            move_piece<uint4>(p, packed, to_packed);
        } else {
            move_piece<unsigned char>(p, packed, to_packed);
        }
    }
}

extern "C" __global__ void pinshm_pack(const PackDesc* descs, unsigned int n, unsigned char* packed) {
    move_all(descs, n, packed, true);
}

extern "C" __global__ void pinshm_unpack(const PackDesc* descs, unsigned int n, unsigned char* packed) {
    move_all(descs, n, packed, false);
}
