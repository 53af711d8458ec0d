"""Run a module with some of the kernel source's compile-time constants changed, to time variants.

    python3 docs/results/decode-round5/with_defines.py MOE_GEMV_DEPTH=1 -- -m microbench.decode_profile ...

Each NAME=VALUE replaces the value of `#define NAME ...` in every kernel source the package builds in
this process (a name the source does not define is an error); a dotted name, MODULE.ATTR=INT, sets
that module's integer constant instead (the Python side of a kernel constant, such as
expertstream.kernels.attention.DECODE_CHUNK). The rest runs as `python3 -m MODULE ARGS`. The package
itself is unchanged: this is how the round's measurements compared its constants.
"""

from __future__ import annotations

import importlib
import re
import runpy
import sys

import expertstream.kernels.launcher as launcher


def main() -> None:
    split = sys.argv.index("--")
    settings = dict(arg.split("=", 1) for arg in sys.argv[1:split])
    defines = {name: value for name, value in settings.items() if "." not in name}
    for name, value in settings.items():
        if "." in name:
            module, attr = name.rsplit(".", 1)
            target = importlib.import_module(module)
            if not isinstance(getattr(target, attr, None), int):
                raise SystemExit(f"{name} is not an integer constant of {module}")
            setattr(target, attr, int(value))
    rest = sys.argv[split + 1 :]
    if len(rest) < 2 or rest[0] != "-m":
        raise SystemExit("usage: with_defines.py NAME=VALUE... -- -m MODULE [ARGS...]")
    original = launcher.kernel_source

    def patched(*args: object, **kwargs: object) -> str:
        source = original(*args, **kwargs)  # type: ignore[arg-type]
        for name, value in defines.items():
            source, n = re.subn(rf"^#define {name} \S+", f"#define {name} {value}", source, flags=re.M)
            if n != 1:
                raise SystemExit(f"#define {name} appears {n} times in the kernel source, not once")
        return source

    launcher.kernel_source = patched  # type: ignore[assignment]
    sys.argv = [rest[1], *rest[2:]]
    runpy.run_module(rest[1], run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
