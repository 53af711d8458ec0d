"""Ring rows under two interpreter switch intervals: does the lookahead worker wait for the lock?

Run 25 of hostmem-h200.md. Usage: python 25-switch-interval-probe.py MODEL.gguf OUT.json
"""
import sys, json, time, logging
import expertstream
from expertstream.model import MoeModel
from expertstream.moe.measure import Settings, measure
from expertstream.moe.runner import Batching
from expertstream.hostmem import HostMemoryMode as H
path, out = sys.argv[1], sys.argv[2]
res = []
with expertstream.backend("cuda") as b, MoeModel.open(path) as m:
    d = b.device(0)
    peak = None
    for ub in (512, 4096):
        for interval in (0.005, 0.0001, 0.005, 0.0001):
            sys.setswitchinterval(interval)
            t = time.perf_counter()
            meas = measure(b, d, m, Settings(Batching(4096, ub, 4), (0, 2), (H.RING,), repeats=2), h2d_peak_gbps=peak)
            peak = meas.baselines.h2d_peak_gbps
            for r in meas.rows:
                row = dict(ub=ub, interval=interval, slots=r.slots, ttft=r.ttft_s, sd=r.ttft_sd_s, dec=r.decode_tokens_per_s,
                           copy=r.ring_copy_pct, wait=r.ring_chunk_wait_pct, slot_wait=r.slot_wait_ms, over=r.over_compute_ms, fill=r.ring_fill)
                res.append(row)
                print(f"ub {ub:5} sw {interval*1e3:5.2f} ms slots {r.slots}: ttft {r.ttft_s:.3f} +- {r.ttft_sd_s:.3f}  decode {r.decode_tokens_per_s:.2f}  copy {r.ring_copy_pct} wait {r.ring_chunk_wait_pct} slotwait {r.slot_wait_ms}", flush=True)
            print(f"  ({time.perf_counter()-t:.0f} s)", flush=True)
sys.setswitchinterval(0.005)
json.dump(res, open(out, "w"), indent=1)
