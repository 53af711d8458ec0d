"""The last operations of a simulated decode trace, one per line: start (us, from the first shown),
duration (us), stream, name. usage: python trace_tail.py TRACE.json [N=60]"""

import json
import sys

events = json.load(open(sys.argv[1]))
events = events["traceEvents"] if isinstance(events, dict) else events
ops = sorted((e for e in events if e.get("ph") == "X"), key=lambda e: e["ts"])[-int(sys.argv[2] if len(sys.argv) > 2 else 60) :]
t0 = ops[0]["ts"]
print("start_us  dur_us  stream  name")
for e in ops:
    print(f"{e['ts'] - t0:8.1f} {e['dur']:7.1f}  {e.get('tid')!s:>6}  {e.get('name')}")
