"""A checksum kernel for scheduler tests, real (CUDA-C, every GPU backend) and simulated (twin).

For each (expert, chunk) of a weight tensor it writes a position-weighted byte sum if the expert
appears in the routing ids, else 0, plus one entry for the padded tail after the tensor. Any byte
a split reads wrongly (stale padding, a slot overwritten too early, a missing copy) changes it.
"""

from __future__ import annotations

import numpy as np

from expertstream.backends.base import BufferView, Device, Kernel, Stream

CHUNK = 256
NAME = "es_test_digest"

SOURCE = r"""
extern "C" __global__ void es_test_digest(const unsigned char* w, unsigned int* out, const int* ids,
                                          int n_ids, int n_expert, long long expert_nbytes,
                                          long long nbytes, long long padded, int chunk) {
    long long chunks = (expert_nbytes + chunk - 1) / chunk;
    long long total = (long long)n_expert * chunks + 1;
    long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= total) return;
    int e;
    long long begin, end;
    if (i == total - 1) {
        e = n_expert - 1;
        begin = nbytes;
        end = padded;
    } else {
        e = (int)(i / chunks);
        begin = e * expert_nbytes + (i % chunks) * chunk;
        end = begin + chunk;
        if (end > (e + 1) * expert_nbytes) end = (e + 1) * expert_nbytes;
    }
    int used = 0;
    for (int k = 0; k < n_ids; ++k) {
        if (ids[k] == e) { used = 1; break; }
    }
    unsigned int h = 0u;
    if (used) {
        for (long long b = begin; b < end; ++b) h += (unsigned int)(w[b] + 1u) * (unsigned int)(b - begin + 1);
    }
    out[i] = h;
}
"""


def n_outputs(n_expert: int, expert_nbytes: int) -> int:
    return n_expert * -(-expert_nbytes // CHUNK) + 1


def reference(data: np.ndarray, ids: np.ndarray, n_expert: int, expert_nbytes: int, padded: int) -> np.ndarray:
    """What the kernel computes, from the host bytes (tail taken as zeros)."""
    full = np.zeros(padded, dtype=np.uint8)
    full[: data.size] = data
    used = set(ids.tolist())
    chunks = -(-expert_nbytes // CHUNK)
    out = np.zeros(n_expert * chunks + 1, dtype=np.uint32)
    ranges: list[tuple[int, int, int]] = []
    for e in range(n_expert):
        for c in range(chunks):
            begin = e * expert_nbytes + c * CHUNK
            ranges.append((e, begin, min(begin + CHUNK, (e + 1) * expert_nbytes)))
    ranges.append((n_expert - 1, data.size, padded))
    for i, (e, begin, end) in enumerate(ranges):
        if e in used:
            seg = full[begin:end].astype(np.uint64) + 1
            out[i] = np.uint32(int((seg * np.arange(1, seg.size + 1, dtype=np.uint64)).sum()) & 0xFFFFFFFF)
    return out


def _run_twin(args: tuple, grid: tuple[int, int, int], block: tuple[int, int, int]) -> None:
    w, out, ids, n_ids, n_expert, expert_nbytes, nbytes, padded, _chunk = args
    ids_arr = ids.view(np.int32)[: int(n_ids)]
    result = reference(w[: int(nbytes)], ids_arr, int(n_expert), int(expert_nbytes), int(padded))
    # The twin reads the real tail bytes, not zeros, exactly like the kernel.
    tail = w[int(nbytes) : int(padded)].astype(np.uint64) + 1
    if int(n_expert) - 1 in set(ids_arr.tolist()):
        result[-1] = np.uint32(int((tail * np.arange(1, tail.size + 1, dtype=np.uint64)).sum()) & 0xFFFFFFFF)
    out.view(np.uint32)[: result.size] = result


def register_twin() -> None:
    from expertstream.backends.sim import Access, KernelSpec, register_kernel

    def accesses(args: tuple) -> list[Access]:
        w, out, ids, n_ids, n_expert, expert_nbytes, nbytes, padded, _chunk = args
        tail = int(padded) > int(nbytes)
        return [
            Access(w, write=False, padded_from=w.offset + int(nbytes) if tail else None),
            Access(ids.buffer.view(ids.offset, 4 * int(n_ids)), write=False),
            Access(out.buffer.view(out.offset, 4 * n_outputs(int(n_expert), int(expert_nbytes))), write=True),
        ]

    register_kernel(KernelSpec(NAME, run=_run_twin, accesses=accesses, flops=lambda args: float(args[7])))


def compile_digest(device: Device) -> Kernel:
    if device.backend.name == "sim":
        register_twin()
    return device.compile(SOURCE, NAME)


def launch(
    stream: Stream,
    kernel: Kernel,
    w: BufferView,
    out: BufferView,
    ids: BufferView,
    n_ids: int,
    n_expert: int,
    expert_nbytes: int,
    nbytes: int,
) -> None:
    total = n_outputs(n_expert, expert_nbytes)
    stream.launch(
        kernel,
        (-(-total // 128),),
        (128,),
        (
            w,
            out,
            ids,
            np.int32(n_ids),
            np.int32(n_expert),
            np.int64(expert_nbytes),
            np.int64(nbytes),
            np.int64(w.nbytes),
            np.int32(CHUNK),
        ),
    )
