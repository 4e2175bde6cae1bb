"""The engine's CUDA kernels compile, here on a machine without a GPU (NVRTC from NVIDIA's PyPI wheels).

``DecodeAttention.create`` and ``PackedAttention.create`` fall back to MLX's ops when their kernel fails to build on
the device, so a kernel broken by an edit would not fail any CPU test: it would only make the GPU slower. This test
compiles each kernel's source, wrapped the way ``mx.fast.cuda_kernel`` wraps it (MLX's ``build_kernel``: the inputs,
their shapes and strides, the outputs, the template constants), for every type and head size the engine runs it with,
to PTX for sm_80 and sm_90, and checks that no per-thread array went to local memory (a register array indexed by a
value the compiler cannot unroll: a silent slowdown).
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import pytest

from mlxbatch.engine.attention import decode as decode_attention
from mlxbatch.engine.attention import packed as packed_attention

_CTYPE = {"bfloat16": "__nv_bfloat16", "float16": "__half", "float32": "float"}

_PRELUDE = """
#include <cuda_bf16.h>
#include <cuda_fp16.h>
typedef int int32_t;
typedef long long int64_t;
struct Shape { int32_t v[8]; __device__ int32_t operator[](int i) const { return v[i]; } };
struct Strides { int64_t v[8]; __device__ int64_t operator[](int i) const { return v[i]; } };
"""


def _nvrtc() -> tuple[ctypes.CDLL, Path]:
    try:
        import nvidia.cuda_nvrtc
        import nvidia.cuda_runtime
    except ImportError:
        pytest.skip("NVRTC is not installed (the dev extra's nvidia-cuda-nvrtc-cu12, Linux x86-64)")
    lib_dir = Path(list(nvidia.cuda_nvrtc.__path__)[0]) / "lib"
    libs = sorted(lib_dir.glob("libnvrtc.so*"))
    include = Path(list(nvidia.cuda_runtime.__path__)[0]) / "include"
    if not libs or not (include / "cuda_bf16.h").exists():
        pytest.skip(f"no libnvrtc in {lib_dir} or no CUDA headers in {include}")
    return ctypes.CDLL(str(libs[0])), include


def _wrap(name: str, inputs: list[str], output: str, dtype: str, header: str, source: str,
          constants: dict[str, object]) -> str:
    """The kernel's source as ``mx.fast.cuda_kernel`` builds it (every input as ``const T*`` with its shape and
    strides; MLX adds those only where the source names them: an unused parameter changes nothing)."""
    t = _CTYPE[dtype]
    params = []
    for i in inputs:
        ct = "int32_t" if i in ("rows", "lengths", "units") else t
        params += [f"const {ct}* {i}", f"const __grid_constant__ Shape {i}_shape",
                   f"const __grid_constant__ Strides {i}_strides"]
    params.append(f"{t}* {output}")
    body = "".join(f"  constexpr int {k} = {v};\n" for k, v in constants.items())
    return (_PRELUDE + header + "namespace mlx::core::cu {\n" + f"__global__ void {name}({', '.join(params)}) {{\n"
            + f"  using T = {t};\n" + body + "  constexpr float SCALE = 1.25e-01f;\n" + source + "\n}\n}\n")


def _compile(lib: ctypes.CDLL, include: Path, src: str, arch: str) -> str:
    prog = ctypes.c_void_p()
    assert lib.nvrtcCreateProgram(ctypes.byref(prog), src.encode(), b"kernel.cu", 0, None, None) == 0
    opts = [f"--gpu-architecture={arch}".encode(), b"-I" + str(include).encode(), b"--std=c++17",
            b"-default-device"]
    rc = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(prog, log)
    assert rc == 0, log.value.decode()
    lib.nvrtcGetPTXSize(prog, ctypes.byref(size))
    ptx = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetPTX(prog, ptx)
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    return ptx.value.decode()


@pytest.mark.parametrize("arch", ["compute_80", "compute_90"])
@pytest.mark.parametrize("dtype,dim,rep", [("bfloat16", 64, 7), ("float16", 128, 4), ("bfloat16", 128, 1),
                                           ("float16", 64, 8)])
def test_packed_prefill_attention_compiles(arch, dtype, dim, rep):
    lib, include = _nvrtc()
    src = _wrap("packed", ["q", "kb", "vb", "units"], "out", dtype, packed_attention.HEADER,
                packed_attention.SOURCE, {"D": dim, "R": rep})
    ptx = _compile(lib, include, src, arch)
    assert ptx.count("mma.sync") >= 2 * (dim // 8) * 4  # the score and value products of a tile, unrolled
    assert ".local" not in ptx


@pytest.mark.parametrize("layout", [0, 1])  # short rows, long rows
@pytest.mark.parametrize("dtype,dim,rep", [("bfloat16", 64, 7), ("float16", 128, 4), ("float32", 64, 1),
                                           ("bfloat16", 128, 16)])
def test_decode_attention_compiles(dtype, dim, rep, layout):
    lib, include = _nvrtc()
    src = _wrap("decode", ["q", "kb", "vb", "rows", "lengths"], "out", dtype, "", decode_attention.SOURCE,
                {"D": dim, "R": rep, "L": layout})
    ptx = _compile(lib, include, src, "compute_80")
    assert ".entry" in ptx
    assert ".local" not in ptx  # the per-head sums (``acc[R][VV]``) and a key's loaded values stay in registers


def test_kernel_sources_are_package_data():
    """Every kernel source file of the package is shipped by ``pip install .`` (pyproject's package-data globs), and
    the modules hold what the files say (read at import)."""
    import fnmatch
    import tomllib

    root = Path(__file__).resolve().parents[2]
    data = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    sources = [p for p in (root / "mlxbatch").rglob("*") if p.suffix in (".cu", ".cuh", ".metal")]
    assert sources, "no kernel source files found"
    for p in sources:
        package = ".".join(p.parent.relative_to(root).parts)
        assert any(fnmatch.fnmatch(p.name, g) for g in data.get(package, [])), f"{p} is not package data"
    assert decode_attention.SOURCE == (root / "mlxbatch/engine/attention/decode.cu").read_text()
    assert packed_attention.HEADER == (root / "mlxbatch/engine/attention/packed.cuh").read_text()
