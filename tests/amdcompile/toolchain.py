"""The AMD compiler the kernels_amd session uses, and what hipRTC carries inside itself, from Debian.

- clang-19, ld.lld-19 and llvm-19's tools come from the machine's own Debian suite (bookworm has
  them): ``apt-get install`` when one is missing.
- hipRTC links ROCm's device libraries and includes a preprocessed runtime header that it keeps
  inside libhiprtc-builtins. Those come from newer Debian suites, fetched with ``apt-get download``
  into a private apt state and unpacked into a cache folder, never installed:
  - rocm-device-libs-17 (trixie; ROCm 6.0): ocml, ockl and the oclc control libraries, LLVM 17
    bitcode that clang-19 reads. It predates gfx12, so it has no ISA-version library for gfx1200
    and gfx1201;
  - those two one-constant libraries from rocm-device-libs-21 (forky or sid; ROCm 7.0), re-encoded for
    LLVM 19 with the data layout of the others (its other libraries are LLVM 21 bitcode, which
    clang-19 cannot read);
  - libhiprtc-builtins6 (forky or sid; ROCm 6.4; else trixie's libhiprtc-builtins5, ROCm 5.7):
    the hiprtc_runtime.h hipRTC includes in every program.

The cache folder is $EXPERTSTREAM_AMD_TOOLCHAIN_DIR, else $XDG_CACHE_HOME (or ~/.cache)
/expertstream/amd-toolchain. ``fetch()`` does nothing when the cache and the tools are there.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

LLVM = 19
SYSTEM_PACKAGES = (f"clang-{LLVM}", f"lld-{LLVM}", f"llvm-{LLVM}")
TOOLS = ("clang", "ld.lld", "llvm-objdump", "llvm-objcopy", "llvm-nm", "llvm-dis", "llvm-as")
MANIFEST = "toolchain.json"
LAYOUT_VERSION = 2  # bump when the cache's shape changes, so an old cache is fetched again


@dataclass(frozen=True)
class DebianPackage:
    name: str
    suite: str

    def __str__(self) -> str:
        return f"{self.name}/{self.suite}"


@dataclass(frozen=True)
class Part:
    """One thing the cache needs, and the packages that have it, the preferred first."""

    role: str
    candidates: tuple[DebianPackage, ...]


# testing (forky) before unstable (sid): a package stays there longer once sid moves on.
DEVICE_LIBS = Part("device libraries", (DebianPackage("rocm-device-libs-17", "trixie"),))
GFX12_ISA_LIBS = Part(
    "gfx12 ISA versions", (DebianPackage("rocm-device-libs-21", "forky"), DebianPackage("rocm-device-libs-21", "sid"))
)
HIPRTC_BUILTINS = Part(
    "hipRTC header",
    (
        DebianPackage("libhiprtc-builtins6", "forky"),
        DebianPackage("libhiprtc-builtins6", "sid"),
        DebianPackage("libhiprtc-builtins5", "trixie"),
    ),
)
GFX12_ISA_VERSIONS = {"1200": 12000, "1201": 12001}  # file suffix -> __oclc_ISA_version
ARCHIVE = "http://deb.debian.org/debian"
KEYRING = "/usr/share/keyrings/debian-archive-keyring.gpg"


class ToolchainMissing(RuntimeError):
    """The compiler or the cached ROCm files are not here; the message says how to get them."""


@dataclass(frozen=True)
class Toolchain:
    root: Path
    bitcode: Path  # ROCm device libraries (--rocm-device-lib-path)
    include: Path  # holds hiprtc_runtime.h
    hip_version: tuple[int, int, int]
    packages: dict[str, str]  # Debian package -> version

    def tool(self, name: str) -> str:
        return f"{name}-{LLVM}"


def cache_dir() -> Path:
    explicit = os.environ.get("EXPERTSTREAM_AMD_TOOLCHAIN_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "expertstream" / "amd-toolchain"


def _missing_tools() -> list[str]:
    return [f"{tool}-{LLVM}" for tool in TOOLS if shutil.which(f"{tool}-{LLVM}") is None]


def locate(root: Path | None = None) -> Toolchain:
    """The toolchain fetch() left, or ToolchainMissing naming what is absent."""
    root = root or cache_dir()
    missing = _missing_tools()
    if missing:
        raise ToolchainMissing(
            f"not on PATH: {', '.join(missing)}; run `python -m tests.amdcompile fetch` "
            f"(apt-get install {' '.join(SYSTEM_PACKAGES)})"
        )
    try:
        manifest = json.loads((root / MANIFEST).read_text())
    except (OSError, ValueError):
        raise ToolchainMissing(f"no ROCm files in {root}; run `python -m tests.amdcompile fetch`") from None
    if manifest.get("layout") != LAYOUT_VERSION:
        raise ToolchainMissing(f"{root} holds an older layout; run `python -m tests.amdcompile fetch`")
    major, minor, patch = manifest["hip_version"]
    return Toolchain(root, root / "bitcode", root / "include", (major, minor, patch), manifest["packages"])


def fetch(root: Path | None = None) -> Toolchain:
    """Install the compiler if needed and fill the cache if it is empty; idempotent."""
    root = root or cache_dir()
    if _missing_tools():
        _apt_install()
    try:
        return locate(root)
    except ToolchainMissing:
        pass
    root.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root.parent, prefix=".fetch-") as scratch:
        staged = Path(scratch) / "toolchain"
        _build_cache(Path(scratch), staged)
        shutil.rmtree(root, ignore_errors=True)
        staged.rename(root)
    return locate(root)


def _run(*command: str) -> str:
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise ToolchainMissing(f"`{' '.join(command)}` failed ({done.returncode}):\n{done.stderr.strip()}")
    return done.stdout


def _apt_install() -> None:
    if os.geteuid() != 0:
        raise ToolchainMissing(
            f"{', '.join(_missing_tools())} missing; as root: apt-get install {' '.join(SYSTEM_PACKAGES)}"
        )
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for command in (
        ["apt-get", "update", "-qq"],
        ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *SYSTEM_PACKAGES],
    ):
        done = subprocess.run(command, capture_output=True, text=True, env=env)
        if done.returncode != 0:
            raise ToolchainMissing(f"`{' '.join(command)}` failed:\n{done.stderr.strip()}")
    if _missing_tools():
        raise ToolchainMissing(f"still missing after apt-get install: {', '.join(_missing_tools())}")


def _build_cache(scratch: Path, staged: Path) -> None:
    debs = _download([DEVICE_LIBS, GFX12_ISA_LIBS, HIPRTC_BUILTINS], scratch / "apt")
    trees = {}
    for role, (_, deb) in debs.items():
        tree = scratch / "unpacked" / deb.stem
        tree.mkdir(parents=True)
        _run("dpkg-deb", "-x", str(deb), str(tree))
        trees[role] = tree
    bitcode = staged / "bitcode"
    bitcode.mkdir(parents=True)
    for library in _bitcode_dir(trees[DEVICE_LIBS.role]).glob("*.bc"):
        shutil.copy2(library, bitcode / library.name)
    layout = _data_layout(bitcode / "oclc_isa_version_1100.bc")
    newer = _bitcode_dir(trees[GFX12_ISA_LIBS.role])
    for suffix, value in GFX12_ISA_VERSIONS.items():
        name = f"oclc_isa_version_{suffix}.bc"
        _reencode_isa_version(newer / name, bitcode / name, layout, value)
    include = staged / "include"
    include.mkdir()
    header = _hiprtc_header(trees[HIPRTC_BUILTINS.role], scratch)
    (include / "hiprtc_runtime.h").write_bytes(header)
    versions = {str(package): _run("dpkg-deb", "-f", str(deb), "Version").strip() for package, deb in debs.values()}
    versions.update({package: _installed_version(package) for package in SYSTEM_PACKAGES})
    header_package = debs[HIPRTC_BUILTINS.role][0]
    manifest = {
        "layout": LAYOUT_VERSION,
        "hip_version": _hip_version(header_package, versions[str(header_package)]),
        "packages": versions,
    }
    (staged / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")


def _download(parts: list[Part], state: Path) -> dict[str, tuple[DebianPackage, Path]]:
    """apt-get download from suites this machine does not use, with an apt state of its own.

    For each part, the first candidate the archive still has; its role -> (package, .deb).
    """
    lists = state / "lists"
    (lists / "partial").mkdir(parents=True)
    (state / "cache" / "archives" / "partial").mkdir(parents=True)
    (state / "sources.list.d").mkdir()
    (state / "status").touch()
    suites = sorted({package.suite for part in parts for package in part.candidates})
    (state / "sources.list").write_text(
        "".join(f"deb [signed-by={KEYRING}] {ARCHIVE} {suite} main\n" for suite in suites)
    )
    options = [
        f"-oDir::Etc::SourceList={state / 'sources.list'}",
        f"-oDir::Etc::SourceParts={state / 'sources.list.d'}",
        f"-oDir::State::Lists={lists}",
        f"-oDir::State::Status={state / 'status'}",
        f"-oDir::Cache={state / 'cache'}",
        "-oAPT::Sandbox::User=root",
    ]
    _run("apt-get", *options, "update", "-qq")
    found: dict[str, tuple[DebianPackage, Path]] = {}
    for part in parts:
        errors = []
        for package in part.candidates:
            folder = state / "debs" / package.suite
            folder.mkdir(parents=True, exist_ok=True)
            done = subprocess.run(
                ["apt-get", *options, "download", str(package)], capture_output=True, text=True, cwd=folder
            )
            if done.returncode == 0:
                found[part.role] = (package, next(folder.glob(f"{package.name}_*.deb")))
                break
            errors.append(f"{package}: {done.stderr.strip()}")
        else:
            raise ToolchainMissing(
                f"no package for the {part.role} is in Debian's archive any more; add a newer candidate in "
                "tests/amdcompile/toolchain.py:\n" + "\n".join(errors)
            )
    return found


def _bitcode_dir(tree: Path) -> Path:
    found = sorted(tree.glob("usr/lib/llvm-*/lib/clang/*/amdgcn/bitcode"))
    if not found:
        raise ToolchainMissing(f"no amdgcn/bitcode folder in {tree}")
    return found[-1]


def _data_layout(bitcode: Path) -> str:
    text = _run(f"llvm-dis-{LLVM}", str(bitcode), "-o", "-")
    match = re.search(r'^target datalayout = ".*"$', text, re.MULTILINE)
    if not match:
        raise ToolchainMissing(f"{bitcode} has no data layout")
    return match.group(0)


def _reencode_isa_version(source: Path, target: Path, layout: str, value: int) -> None:
    text = _run(f"llvm-dis-{LLVM}", str(source), "-o", "-")
    if not re.search(rf"@__oclc_ISA_version = .* constant i32 {value}\b", text):
        raise ToolchainMissing(f"{source} does not define __oclc_ISA_version = {value}")
    rewritten = re.sub(r'^target datalayout = ".*"$', layout, text, flags=re.MULTILINE)
    done = subprocess.run([f"llvm-as-{LLVM}", "-o", str(target)], input=rewritten, capture_output=True, text=True)
    if done.returncode != 0:
        raise ToolchainMissing(f"llvm-as-{LLVM} could not re-encode {source}:\n{done.stderr.strip()}")


def _hiprtc_header(tree: Path, scratch: Path) -> bytes:
    """The .hipRTC_header section of libhiprtc-builtins: the header text, then its 32-bit size."""
    library = next(path for path in tree.glob("usr/lib/*/libhiprtc-builtins.so.*") if not path.is_symlink())
    section = scratch / "hiprtc_header.bin"
    _run(f"llvm-objcopy-{LLVM}", f"--dump-section=.hipRTC_header={section}", str(library), str(scratch / "discard"))
    data = section.read_bytes()
    (size,) = struct.unpack_from("<I", data, len(data) - 4)
    if size != len(data) - 4:
        raise ToolchainMissing(f"{library}: .hipRTC_header holds {len(data)} bytes but says {size} + 4")
    return data[:size]


def _installed_version(package: str) -> str:
    return _run("dpkg-query", "-W", "-f=${Version}", package).strip()


def _hip_version(package: DebianPackage, package_version: str) -> list[int]:
    match = re.match(r"(\d+)\.(\d+)\.(\d+)", package_version)
    if not match:
        raise ToolchainMissing(f"cannot read a HIP version from {package} {package_version}")
    return [int(part) for part in match.groups()]
