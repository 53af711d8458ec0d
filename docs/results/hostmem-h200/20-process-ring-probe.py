# The probe as run (not part of the package); output in 20-process-ring-probe.txt.
"""Probe: a staging ring whose chunk fills run in helper processes (not product code)."""
import os, sys, time, struct, mmap, subprocess, itertools
import numpy as np

CMD = struct.Struct("<qqqq")  # seq, src_offset, chunk_offset, nbytes
DONE = struct.Struct("<qd")

def child(src_fd, shm_fd, shm_size, cmd_fd, done_fd):
    src = np.frombuffer(mmap.mmap(src_fd, 0, prot=mmap.PROT_READ), np.uint8)
    shm = np.frombuffer(mmap.mmap(shm_fd, shm_size), np.uint8)
    r = os.fdopen(cmd_fd, "rb", buffering=0)
    while True:
        b = r.read(CMD.size)
        if len(b) < CMD.size:
            return
        seq, so, co, n = CMD.unpack(b)
        if seq < 0:
            return
        t = time.perf_counter()
        np.copyto(shm[co:co + n], src[so:so + n])
        os.write(done_fd, DONE.pack(seq, time.perf_counter() - t))

if __name__ == "__main__" and sys.argv[1] == "child":
    child(*map(int, sys.argv[2:7])); sys.exit(0)

from cuda.bindings import driver as cu

def main(path):
    cu.cuInit(0); _, dev = cu.cuDeviceGet(0); _, ctx = cu.cuDevicePrimaryCtxRetain(dev); cu.cuCtxSetCurrent(ctx)
    src_fd = os.open(path, os.O_RDONLY)
    size = os.fstat(src_fd).st_size
    _, stream = cu.cuStreamCreate(1)
    print("procs chunks chunk_mib part_mib GB/s")
    for procs, chunks, chunk_mib, part_mib in [(12, 8, 32, 8), (12, 16, 8, 8), (12, 32, 4, 4), (12, 16, 4, 4), (12, 24, 8, 8), (16, 16, 8, 8), (14, 16, 8, 8), (12, 12, 16, 8), (12, 48, 2, 2)]:
        chunk = chunk_mib << 20; part = part_mib << 20
        shm_size = chunks * chunk
        shm_fd = os.memfd_create("ring")
        os.ftruncate(shm_fd, shm_size)
        shm = mmap.mmap(shm_fd, shm_size)
        arr = np.frombuffer(shm, np.uint8)
        addr = arr.ctypes.data
        err, = cu.cuMemHostRegister(addr, shm_size, 0)
        assert err == 0, err
        _, dptr = cu.cuMemAlloc(chunk)
        events = [cu.cuEventCreate(2)[1] for _ in range(chunks)]
        kids = []
        for i in range(procs):
            cr, cw = os.pipe(); dr, dw = os.pipe()
            p = subprocess.Popen([sys.executable, __file__, "child", str(src_fd), str(shm_fd), str(shm_size), str(cr), str(dw)], pass_fds=(src_fd, shm_fd, cr, dw))
            os.close(cr); os.close(dw)
            kids.append([p, cw, dr, 0, 0])  # proc, cmd write, done read, sent, done
        total = 6 << 30
        span = (size // chunk - 1) * chunk
        parts_per = chunk // part
        # pipeline
        def start_fill(k, c):
            so = (k * chunk) % span
            owners = []
            for j in range(parts_per):
                kid = kids[(k * parts_per + j) % procs]
                kid[3] += 1
                os.write(kid[1], CMD.pack(kid[3], so + j * part, c * chunk + j * part, part))
                owners.append((kid, kid[3]))
            return owners
        def wait_fill(owners):
            for kid, seq in owners:
                while kid[4] < seq:
                    b = os.read(kid[2], DONE.size * 64)
                    kid[4] += len(b) // DONE.size
        n = total // chunk
        for rep in range(2):
            t = time.perf_counter()
            inflight = {}
            for k in range(min(chunks, n)):  # piece k into chunk k
                inflight[k] = start_fill(k, k)
            for k in range(n):
                c = k % chunks
                wait_fill(inflight.pop(k))
                cu.cuMemcpyHtoDAsync(dptr, addr + c * chunk, chunk, stream)
                cu.cuEventRecord(events[c], stream)
                pk = k - 1
                if pk >= 0 and pk + chunks < n:
                    pc = pk % chunks
                    cu.cuEventSynchronize(events[pc])
                    inflight[pk + chunks] = start_fill(pk + chunks, pc)
            cu.cuStreamSynchronize(stream)
            dt = time.perf_counter() - t
        print(procs, chunks, chunk_mib, part_mib, f"{n * chunk / dt / 1e9:.1f}", flush=True)
        for kid in kids:
            os.write(kid[1], CMD.pack(-1, 0, 0, 0)); kid[0].wait()
        cu.cuMemHostUnregister(addr); cu.cuMemFree(dptr)
        del arr; shm.close(); os.close(shm_fd)

main(sys.argv[1])
