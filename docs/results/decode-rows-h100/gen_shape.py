"""Write the matrix-vector harness's sources, one per variant of gemv.cu's block shape and bound."""
import re
import sys
from pathlib import Path

from gguf import GGMLQuantizationType as Q

from expertstream.kernels.layout import weight_format
from expertstream.kernels.program import SOURCE_NAMES, _instances, source_file

out = Path(sys.argv[1])
harness = Path(sys.argv[2]).read_text()
names = [n for n in SOURCE_NAMES if n not in ("attention.cu", "recurrent.cu", "mma.cu", "int8.cu", "direct.cu")]
lines = [line for t in (Q.Q4_K, Q.Q6_K) for _, line in _instances(weight_format(t)) if "VEC" in line]
# name: (threads a block, rows a wave, blocks a multiprocessor on NVIDIA)
VARIANTS = {"s0": (256, 2, 4), "s1": (256, 4, 4), "s2": (256, 4, 3), "s3": (256, 1, 4), "s4": (512, 2, 2),
            "s5": (128, 2, 8), "s6": (512, 1, 2)}


def gemv(threads: int, rows: int, blocks: int) -> str:
    text = source_file("gemv.cu")
    for pattern, value in ((r"#define MOE_GEMV_THREADS 256\n", f"#define MOE_GEMV_THREADS {threads}\n"),
                           (r"#define MOE_GEMV_WAVE_ROWS 2 ", f"#define MOE_GEMV_WAVE_ROWS {rows} "),
                           (r"#define MOE_GEMV_MIN_BLOCKS 4\n", f"#define MOE_GEMV_MIN_BLOCKS {blocks}\n")):
        text, n = re.subn(pattern, value, text)
        assert n == 1, pattern
    return text


only = sys.argv[3:] or list(VARIANTS)
for name in only:
    files = [gemv(*VARIANTS[name]) if n == "gemv.cu" else source_file(n) for n in names]
    (out / f"h_{name}.cu").write_text("\n".join(files) + "\n" + "\n".join(lines) + "\n" + harness)
print(" ".join(only))
