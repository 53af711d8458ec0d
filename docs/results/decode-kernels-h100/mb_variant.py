"""Edit a tree's gemv.cu into a launch-bounds variant: `all` (every matrix-vector kernel at least 8 blocks a
multiprocessor), `experts` (mul_mat_vec_id and gate_up_vec_id only; mul_mat_vec_parts keeps 1)."""
import sys
from pathlib import Path

path = Path(sys.argv[1]) / "expertstream/kernels/gemv.cu"
which = sys.argv[2]
s = path.read_text()
s = s.replace("#define MOE_GEMV_MIN_BLOCKS 1 ", "#define MOE_GEMV_MIN_BLOCKS 8 ", 1)
assert "#define MOE_GEMV_MIN_BLOCKS 8 " in s
if which == "experts":
    head = "#define MOE_MUL_MAT_VEC_PARTS(NAME, TYPE)"
    at = s.index(head)
    end = s.index("__launch_bounds__(MOE_GEMV_THREADS, MOE_GEMV_MIN_BLOCKS)", at)
    s = s[:end] + "__launch_bounds__(MOE_GEMV_THREADS, 1)                  " + s[end + len("__launch_bounds__(MOE_GEMV_THREADS, MOE_GEMV_MIN_BLOCKS)"):]
path.write_text(s)
