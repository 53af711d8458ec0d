"""Fill processes: preadv vs copies out of a mapping, host only (no GPU). Run 24 of hostmem-h200.md.

Ran against a variant of expertstream/hostmem (not kept): FillProcesses took a ``method``, "map"
(the child copies out of its mapping, as shipped) or "read" (the child fills the chunk with
os.preadv from the file), and ``pick(source, offset)`` chose a process by hash((source, offset))
for "map". Usage: python 24-fill-copy-methods-probe.py MODEL.gguf OUT.json (PROCS=12).
"""
import mmap, os, random, sys, time, json
from expertstream.hostmem.fillproc import FillProcesses, FileSpan

path = sys.argv[1]; out = sys.argv[2]
P = int(os.environ.get("PROCS", "12"))
CH, CB, PART = 16, 8 << 20, 4 << 20

class Chunks:
    def __init__(self):
        self.stride = CB; self.nbytes = CH * CB
        self.fd = os.memfd_create("probe"); os.ftruncate(self.fd, self.nbytes)
    def offset(self, c): return c * self.stride

size = os.path.getsize(path)
res = []
for method, assign in (("map", "rr"), ("map", "hash"), ("read", "rr"), ("map", "hash"), ("read", "rr"), ("map", "rr")):
    fd = os.open(path, os.O_RDONLY)
    chunks = Chunks()
    fp = FillProcesses(P, [FileSpan(fd, 0)], chunks, method=method)
    for p in range(3):  # streaming passes over the file, assignment shifted each pass
        t = time.perf_counter(); inflight = []; j = 0; took = 0.0
        for off in range(0, size - PART, PART):
            slot = j % (CH * 2)
            if len(inflight) >= CH * 2:
                c, s = inflight.pop(0); took += fp.wait(c, s)
            child = (j + p * 5) % P if assign == "rr" else fp.pick(0, off)
            inflight.append((child, fp.send(child, 0, off, slot // 2, (slot % 2) * PART, PART))); j += 1
        for c, s in inflight: took += fp.wait(c, s)
        dt = time.perf_counter() - t
        res.append(dict(method=method + "-" + assign, kind="stream", pass_=p, gbps=size / dt / 1e9, part_ms=1e3 * took / j))
    for p in range(2):
        rng = random.Random(1)  # one 2.6 MB copy at a time from random places (a decode step's experts)
        n = 400; t = time.perf_counter(); took = 0.0
        for i in range(n):
            off = rng.randrange(0, size - (3 << 20)) & ~4095
            child = i % P if assign == "rr" else fp.pick(0, off)
            took += fp.wait(child, fp.send(child, 0, off, i % CH, 0, 2_654_208))
        dt = time.perf_counter() - t
        res.append(dict(method=method + "-" + assign, kind="single", pass_=p, gbps=n * 2_654_208 / dt / 1e9, part_ms=1e3 * took / n, wall_ms=1e3 * dt / n))
    fp.close(); os.close(chunks.fd); os.close(fd)
json.dump(res, open(out, "w"), indent=1)
for r in res: print(f"{r['method']:9} {r['kind']:6} pass {r['pass_']}: {r['gbps']:6.1f} GB/s  copy {r['part_ms']:.3f} ms" + (f" wall {r['wall_ms']:.3f} ms" if 'wall_ms' in r else ""))
