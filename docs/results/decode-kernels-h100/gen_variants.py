"""Write the matrix-vector harness's sources, one per variant, into the directory given."""
import re
import sys
from pathlib import Path

from gguf import GGMLQuantizationType as Q

from expertstream.kernels.layout import weight_format
from expertstream.kernels.program import SOURCE_NAMES, _instances, source_file

out = Path(sys.argv[1])
harness = Path(sys.argv[2]).read_text()
old_gemv = Path(sys.argv[3]).read_text()
names = [n for n in SOURCE_NAMES if n not in ("attention.cu", "recurrent.cu", "mma.cu", "int8.cu", "direct.cu")]
lines = [line for t in (Q.Q4_K, Q.Q6_K) for _, line in _instances(weight_format(t)) if "VEC" in line]


def source(gemv: str) -> str:
    files = [gemv if n == "gemv.cu" else source_file(n) for n in names]
    return "\n".join(files) + "\n" + "\n".join(lines) + "\n" + harness


def sub(text: str, name: str, value: str) -> str:
    new, n = re.subn(rf"#define {name} \S+", f"#define {name} {value}", text)
    assert n == 1, name
    return new


new = Path(sys.argv[4]).read_text() if len(sys.argv) > 4 else source_file("gemv.cu")
variants = {"base": old_gemv, "new": new}
for name, gemv in variants.items():
    (out / f"h_{name}.cu").write_text(source(gemv))
print(" ".join(variants))
