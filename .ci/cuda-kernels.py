"""Compiles every specialisation of the crate's CUDA kernels with NVRTC, as the crate does at
first use, then assembles each with ptxas for sm_90 (H100/H200) and prints its resource report
(registers, spills, shared memory). Needs no GPU: NVRTC and ptxas come from PyPI's CUDA 13
wheels (see .ci/cuda-kernels, which installs them).

The specialisations are read from the crate's sources (`ARCH` in `src/cuda/nvrtc.rs`;
`HEAD_DIMS` with bf16 and f16 each and `F32_HEAD_DIMS` with f32, with and without a value term,
in `src/attention/cuda/kernel.rs`, whose `forward_defines` passes the same -D options), plus the
rotation in place of `src/cuda/rope.rs` per dtype, so the script compiles what the crate
compiles at run time.
"""
import ctypes
import os
import pathlib
import re
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parent.parent
KERNELS = ROOT / "src" / "attention" / "cuda"


def specialisations():
    """(kernel file, [options], label) per specialisation, from ARCH and HEAD_DIMS."""
    src = (KERNELS / "kernel.rs").read_text()
    nvrtc = (ROOT / "src" / "cuda" / "nvrtc.rs").read_text()
    arch = re.search(r'const ARCH: &str = "([^"]+)";', nvrtc).group(1)
    def consts(name):
        found = re.search(rf"const {name}: \[usize; \d+\] = \[([^\]]+)\];", src)
        return [int(d) for d in found.group(1).split(",")]
    out = []
    # (dims, -DPOSENC_BF16, -DPOSENC_F32, label): bf16 and f16 at HEAD_DIMS, f32 at
    # F32_HEAD_DIMS.
    for dims, bf16, f32, name in ((consts("HEAD_DIMS"), 1, 0, "bf16"), (consts("HEAD_DIMS"), 0, 0, "f16"),
                                  (consts("F32_HEAD_DIMS"), 0, 1, "f32")):
        for d in dims:
            for values in (0, 1):
                opts = [f"--gpu-architecture={arch}", f"-DPOSENC_HEAD_DIM={d}",
                        f"-DPOSENC_BF16={bf16}", f"-DPOSENC_F32={f32}", f"-DPOSENC_VALUES={values}"]
                label = f"d{d} {name}{' values' if values else ''}"
                out.append((KERNELS / "flash_forward.cu", opts, label))
    # The rotation in place (src/cuda/rope.rs): one specialisation per dtype.
    for code, name in enumerate(("f32", "bf16", "f16", "f64")):
        opts = [f"--gpu-architecture={arch}", f"-DPOSENC_ROPE_DTYPE={code}"]
        out.append((ROOT / "src" / "cuda" / "rope_in_place.cu", opts, name))
    return arch, out


def nvrtc(lib, source, name, options):
    prog = ctypes.c_void_p()
    check = lambda rc, what: rc == 0 or sys.exit(f"{what} failed: {rc}")
    check(lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), name.encode(), 0, None, None), "nvrtcCreateProgram")
    opts = (ctypes.c_char_p * len(options))(*[o.encode() for o in options])
    rc = lib.nvrtcCompileProgram(prog, len(options), opts)
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(prog, log)
    if rc != 0:
        sys.exit(f"NVRTC failed for {name} {options}:\n{log.value.decode()}")
    lib.nvrtcGetPTXSize(prog, ctypes.byref(size))
    ptx = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetPTX(prog, ptx)
    return ptx.value.decode(), log.value.decode().strip()


def main():
    cuda = pathlib.Path(sys.argv[1])
    lib = ctypes.CDLL(str(next((cuda / "lib").glob("libnvrtc.so*"))))
    arch, specs = specialisations()
    failed = False
    # CUDA_KERNELS_ONLY="d128 bf16": only the specialisations whose label holds it.
    only = os.environ.get("CUDA_KERNELS_ONLY", "")
    for file, opts, label in specs:
        if only not in label:
            continue
        ptx, log = nvrtc(lib, file.read_text(), file.name, opts)
        if log:
            print(f"{label}: NVRTC says:\n{log}")
        with tempfile.TemporaryDirectory() as tmp:
            path = pathlib.Path(tmp) / "k.ptx"
            path.write_text(ptx)
            res = subprocess.run([str(cuda / "bin" / "ptxas"), "-v", "-arch=sm_90", str(path), "-o", str(pathlib.Path(tmp) / "k.cubin")],
                                 capture_output=True, text=True)
        # ptxas reports each entry function: its name, then its stack, spills and registers.
        reports, current = {}, None
        for line in res.stderr.splitlines():
            m = re.search(r"Compiling entry function '(\w+)'", line)
            if m:
                current = m.group(1)
                reports[current] = []
            elif current and ("Used" in line or "spill" in line):
                reports[current].append(line.split("info    : ")[-1].strip())
        for name, lines in reports.items():
            print(f"{name} {label}: {'; '.join(lines)}")
        if res.returncode != 0:
            print(res.stderr)
            failed = True
        if re.search(r"[1-9]\d* bytes spill", res.stderr):
            print(f"  {label} spills registers")
            failed = True
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
