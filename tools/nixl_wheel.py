"""A NIXL wheel cut down to what the nixl backend loads, so it fits the GPU machine's transfer limit.

The device tool carries at most 64 MiB of working tree to the GPU machine, wheels included, and the
nixl-cu13 wheel alone is 59 MiB (238 MiB unpacked). The nixl backend uses a small part of it: the
Python bindings, NIXL's core libraries, the UCX plug-in, UCX itself and UCX's CUDA and CMA transport
modules. The rest is dropped, each for a reason that holds for the kit's one-GPU, two-process step:

  nixl_ep_*/                 NIXL's expert-parallel all-to-all kernels (90 MiB, built only for torch 2.12-2.14);
                             nothing here imports them
  plug-ins other than UCX    GDS, GDS_MT, POSIX, OBJ, AZURE_BLOB, GUSLI, INFINIA, LIBFABRIC, GPUNETIO (storage and
                             other fabrics): the backend creates its agents with backends=["UCX"] only; the
                             libraries only they link (AWS SDK, Azure, curl, libxml2, libaio, liburing, ...)
                             go with them
  telemetry, trace plug-ins  loaded only when NIXL telemetry is switched on by environment
  <pkg>.libs/nixl/           a second copy of the plug-ins, outside the directory NIXL loads plug-ins from
                             (`.<pkg>.mesonpy.libs/plugins`, the one /proc/self/maps shows loaded)
  UCX InfiniBand modules     ib, ib_mlx5*, ib_efa and the rdma-core libraries they link (ibverbs, mlx5, nl):
                             no NIC lies between two processes on one GPU; UCX skips modules that are absent
  UCX perftest modules, libtool .la files, C++ headers, pkg-config, example scripts

What stays is not listed by hand: the Python package, the UCX plug-in and the UCX modules named in
`KEPT_UCX_MODULES` are the roots, and every shared library a kept one names (ELF DT_NEEDED) that the wheel
contains is kept too, transitively. A NEEDED library the wheel does not contain is left to the system, as
the original wheel leaves it (libc, libstdc++, libssl, libz, the CUDA driver and runtime). The result is
checked before it is written (bindings, core library, UCX plug-in and UCX present), and tested by
installing the same cut of the CPU machine's nixl-cu12 and moving bytes through it
(tests/unit/test_nixl_wheel.py).

The repacked wheel carries a build tag (`-0stripped-`) in its file name and `WHEEL`, and a fresh `RECORD`.
Stdlib only: it runs in `./dev device-check --prepare` and in tests.
"""

from __future__ import annotations

import base64
import hashlib
import re
import struct
import zipfile
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

BUILD_TAG = "0stripped"
KEPT_PLUGINS = ("UCX",)  # the nixl backend's agents are created with backends=["UCX"]
# UCX transport modules, dlopen()ed by UCX by name (no NEEDED edge reaches them): cuda = cuda_copy,
# cuda_ipc and gdr_copy (VRAM, and VRAM between processes on one GPU); cma = host memory between processes.
KEPT_UCX_MODULES = ("uct_cuda", "ucm_cuda", "uct_cma")
_SO = re.compile(r"\.so(\.\d+)*$")


class WheelStripError(RuntimeError):
    """The cut-down wheel would not work (a part the backend loads is missing); nothing was written."""


@dataclass
class StripReport:
    source: str
    output: str
    source_bytes: int  # the wheel files' sizes
    output_bytes: int
    kept: list[str]
    dropped: list[str]
    external: list[str]  # NEEDED libraries neither wheel contains: the system's (as for the original wheel)
    notes: dict[str, str] = field(default_factory=dict)


def elf_needed(data: bytes) -> list[str]:
    """The DT_NEEDED names of a 64-bit little-endian ELF file (what the dynamic loader must find)."""
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        raise WheelStripError("not a 64-bit little-endian ELF file")
    (shoff,) = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    names = []
    for _name, sh_type, _flags, _addr, offset, size, link, _info, _align, _entsize in sections:
        if sh_type != 6:  # SHT_DYNAMIC
            continue
        strtab_offset = sections[link][4]
        for pos in range(offset, offset + size, 16):
            tag, value = struct.unpack_from("<qQ", data, pos)
            if tag == 0:  # DT_NULL
                break
            if tag == 1:  # DT_NEEDED
                start = strtab_offset + value
                names.append(data[start : data.index(b"\0", start)].decode())
    return names


def _parse_name(filename: str) -> tuple[str, str, str]:
    """(distribution, version, tags) of a wheel file name without a build tag."""
    parts = filename[: -len(".whl")].split("-")
    if len(parts) != 5:
        raise WheelStripError(f"{filename}: expected name-version-python-abi-platform.whl (no build tag)")
    return parts[0], parts[1], "-".join(parts[2:])


def _is_lib(path: str) -> bool:
    return bool(_SO.search(path))


def _record_line(path: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{path},sha256={digest},{len(data)}"


def strip_nixl_wheel(source: Path, out_dir: Path) -> StripReport:
    """Write the cut-down copy of the NIXL wheel `source` (nixl_cu12 or nixl_cu13) into `out_dir`."""
    dist, version, tags = _parse_name(source.name)
    pkg = dist  # the import package has the distribution's normalized name (nixl_cu13)
    dist_info, meson_libs, libs = f"{dist}-{version}.dist-info/", f".{pkg}.mesonpy.libs/", f"{pkg}.libs/"
    with zipfile.ZipFile(source) as zf:
        names = [i.filename for i in zf.infolist() if not i.is_dir()]
        # where the loader finds NEEDED libraries: the RUNPATHs of the wheel's own objects point at these
        lib_dirs = {pkg, meson_libs.rstrip("/"), libs.rstrip("/"), f"{libs}ucx"}
        by_basename: dict[str, list[str]] = {}
        for n in names:
            if _is_lib(n) and str(PurePosixPath(n).parent) in lib_dirs:
                by_basename.setdefault(PurePosixPath(n).name, []).append(n)
        roots = [n for n in names if n.startswith(f"{pkg}/")]
        roots += [f"{meson_libs}plugins/libplugin_{p}.so" for p in KEPT_PLUGINS]
        roots += [n for n in names if n.startswith(f"{libs}ucx/lib") and _is_lib(n)
                  and PurePosixPath(n).name.split(".so")[0][3:] in KEPT_UCX_MODULES]  # fmt: skip
        missing_roots = [r for r in roots if r not in names]
        if missing_roots:
            raise WheelStripError(f"{source.name} has no {missing_roots}: not the NIXL wheel layout this cut expects")
        keep, todo, external = set(), list(roots), set()
        while todo:
            path = todo.pop()
            if path in keep:
                continue
            keep.add(path)
            if not _is_lib(path):
                continue
            for needed in elf_needed(zf.read(path)):
                if needed in by_basename:
                    todo += by_basename[needed]
                else:
                    external.add(needed)
        keep |= {n for n in names if n.startswith(dist_info) and not n.endswith(("/RECORD", "/WHEEL"))}
        _check(keep, pkg, meson_libs, libs, source.name)

        out_dir.mkdir(parents=True, exist_ok=True)
        output = out_dir / f"{dist}-{version}-{BUILD_TAG}-{tags}.whl"
        records = []
        with zipfile.ZipFile(output, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as out:
            for info in zf.infolist():
                if info.filename not in keep:
                    continue
                data = zf.read(info)
                out.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED, compresslevel=9)  # keeps the mode bits
                records.append(_record_line(info.filename, data))
            wheel = zf.read(f"{dist_info}WHEEL").decode()
            wheel = "".join(ln for ln in wheel.splitlines(keepends=True) if not ln.startswith("Build:"))
            wheel = wheel.rstrip("\n") + f"\nBuild: {BUILD_TAG}\n"
            out.writestr(f"{dist_info}WHEEL", wheel)
            records.append(_record_line(f"{dist_info}WHEEL", wheel.encode()))
            records.append(f"{dist_info}RECORD,,")
            out.writestr(f"{dist_info}RECORD", "\n".join(records) + "\n")
    return StripReport(
        source=source.name,
        output=output.name,
        source_bytes=source.stat().st_size,
        output_bytes=output.stat().st_size,
        kept=sorted(keep),
        dropped=sorted(set(names) - keep - {f"{dist_info}RECORD", f"{dist_info}WHEEL"}),
        external=sorted(external),
        notes={"plugins": ",".join(KEPT_PLUGINS), "ucx_modules": ",".join(KEPT_UCX_MODULES)},
    )


def _check(keep: set[str], pkg: str, meson_libs: str, libs: str, wheel: str) -> None:
    """What the nixl backend loads must all be there: bindings, core, UCX plug-in, UCX."""

    def has(pattern: str) -> bool:
        return any(re.fullmatch(pattern, k) for k in keep)

    required = {
        "the Python API": re.escape(f"{pkg}/_api.py"),
        "the bindings": re.escape(f"{pkg}/_bindings.") + r".*\.so",
        "NIXL's core library": re.escape(f"{meson_libs}libnixl.so"),
        "the UCX plug-in": re.escape(f"{meson_libs}plugins/libplugin_UCX.so"),
        **{f"UCX's lib{x}": re.escape(f"{libs}lib{x}") + r"[-.].*" for x in ("ucp", "uct", "ucs", "ucm")},
    }
    absent = [what for what, pattern in required.items() if not has(pattern)]
    if absent:
        raise WheelStripError(f"the cut of {wheel} would lack {', '.join(absent)}; not written")
