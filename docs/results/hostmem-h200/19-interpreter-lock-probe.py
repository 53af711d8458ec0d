# The probe as run (not part of the package); output in 19-interpreter-lock-probe.txt.
"""What caps many threads' small operations: the interpreter lock or the driver? (probe, not product code)"""
import itertools, os, sys, threading, time, mmap, multiprocessing as mp
import numpy as np
from cuda.bindings import driver as cu

path = sys.argv[1]
size = os.path.getsize(path)
src = np.memmap(path, dtype=np.uint8, mode="r")
cu.cuInit(0)
_, dev = cu.cuDeviceGet(0)
_, ctx = cu.cuDevicePrimaryCtxRetain(dev)
cu.cuCtxSetCurrent(ctx)
GIB = 3 << 30

def pinned(n):
    err, p = cu.cuMemHostAlloc(n, 0)
    assert err == 0, err
    return np.ctypeslib.as_array((np.ctypeslib.ctypes.c_uint8 * n).from_address(int(p)))

def run_threads(nthreads, part, extra):
    count = GIB // part
    span = (size // part - 1) * part
    counter = itertools.count()
    bufs = [pinned(part) for _ in range(nthreads)]
    events = []
    for _ in range(nthreads):
        _, e = cu.cuEventCreate(cu.CUevent_flags.CU_EVENT_DISABLE_TIMING); events.append(e)
    def work(i):
        cu.cuCtxSetCurrent(ctx)
        dst, ev = bufs[i], events[i]
        while (k := next(counter)) < count:
            s = (k * part) % span
            np.copyto(dst, src[s:s + part])
            if extra == "query":
                cu.cuEventQuery(ev); cu.cuEventQuery(ev); cu.cuEventQuery(ev)
            elif extra == "sleep0":
                time.sleep(0); time.sleep(0); time.sleep(0)
            elif extra == "python":
                x = 0
                for j in range(300): x += j
    ts = [threading.Thread(target=work, args=(i,)) for i in range(nthreads)]
    t = time.perf_counter()
    for th in ts: th.start()
    for th in ts: th.join()
    return count * part / (time.perf_counter() - t) / 1e9

def _proc(args):
    i, nproc, part, count, span, shm_name = args
    s = np.memmap(path, dtype=np.uint8, mode="r")
    dst = np.empty(part, np.uint8)
    for k in range(i, count, nproc):
        o = (k * part) % span
        np.copyto(dst, s[o:o + part])
    return 0

def run_procs(nproc, part):
    count = GIB // part
    span = (size // part - 1) * part
    with mp.get_context("spawn").Pool(nproc) as pool:
        pool.map(_proc, [(i, nproc, part, 8, span, None) for i in range(nproc)])  # warm
        t = time.perf_counter()
        pool.map(_proc, [(i, nproc, part, count, span, None) for i in range(nproc)])
        return count * part / (time.perf_counter() - t) / 1e9

if __name__ == "__main__":
    print(f"python {sys.version.split()[0]} switch {sys.getswitchinterval()}")
    print("threads part_mib plain query3 sleep0x3 python300 procs")
    run_threads(4, 8 << 20, "plain")
    for part_mib in (2, 4, 8):
        for n in (8, 12, 16):
            part = part_mib << 20
            r = [run_threads(n, part, x) for x in ("plain", "query", "sleep0", "python")]
            p = run_procs(n, part)
            print(n, part_mib, " ".join(f"{v:.1f}" for v in r), f"{p:.1f}", flush=True)
