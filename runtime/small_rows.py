"""The float32 arithmetic of a decode step's few rows on x86-64 CPUs with AVX2 + FMA: the product
y = x W^T, RMSNorm, and attention over each row's own list of cache slots. The product runs
AVX-512 where the CPU has it (bit-identical results, 1.3-1.5x faster; `set_isa`, or
`ENTMTP_SMALL_ROWS_ISA=avx2` to compare).

Why it exists: on a CPU a decode step is bound by reading the weights, so verifying a tree of R
tokens should cost about one token's forward. torch's BLAS (MKL) re-reads or repacks the weights
for 2..32 rows; on a 2-core AVX2 EPYC a 3-token forward cost 1.5x a one-token forward with it and
~1.1x with this kernel, and the one-token forward itself got ~1.4x faster. See
`runtime/csrc/small_rows.c` for the kernels and why each row's result does not depend on how many
rows the call holds or where its keys sit in the cache: with all three, every decode forward is
row-invariant by construction, so the exact lossless mode costs nothing extra.

The kernel is plain C compiled once per machine with the system C compiler into a cache folder
(`$ENTMTP_CACHE_DIR`, else `$XDG_CACHE_HOME/entmtp`, else `~/.cache/entmtp`) and loaded with
ctypes: no build step, no extra dependency. Where it cannot be used (no AVX2/FMA, not Linux x86-64,
no compiler, `ENTMTP_SMALL_ROWS=0`) `available()` is False and `runtime.model.Linear` keeps torch's
products; the reason is in `unavailable_reason()`.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path

import torch
from torch import Tensor

PANEL = 16  # output rows per packed panel (the kernel's register tile is 6 rows x 16 outputs)
_SOURCE = Path(__file__).parent / "csrc" / "small_rows.c"
_FLAGS = ["-O3", "-mavx2", "-mfma", "-fopenmp", "-shared", "-fPIC", "-Werror=implicit-function-declaration",
          "-Wl,--no-undefined"]
_LIBS = ["-lm"]  # after the source: the linker resolves left to right

_lib: ctypes.CDLL | None = None
_reason: str | None = None  # why the kernel is unavailable; None = not probed yet or available
_probed = False


def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _cache_dir() -> Path:
    if os.environ.get("ENTMTP_CACHE_DIR"):
        return Path(os.environ["ENTMTP_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "entmtp"


def _build(compiler: str) -> Path:
    """Compile the kernel (once per source, flags and compiler) and return the shared object.
    Written under a temporary name and renamed, so concurrent first uses cannot load half a file."""
    source = _SOURCE.read_bytes()
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True).stdout.split("\n")[0]
    digest = hashlib.sha256(source + " ".join(_FLAGS + _LIBS + [version]).encode()).hexdigest()[:16]
    folder = _cache_dir() / "kernels"
    target = folder / f"small_rows-{digest}.so"
    if target.exists():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, suffix=".so.tmp")
    os.close(fd)
    try:
        done = subprocess.run([compiler, *_FLAGS, str(_SOURCE), "-o", tmp, *_LIBS], capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"{compiler} failed on {_SOURCE}: {done.stderr.strip()[:500]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


def _load() -> None:
    global _lib, _reason, _probed
    _probed = True
    if os.environ.get("ENTMTP_SMALL_ROWS", "1") == "0":
        _reason = "disabled by ENTMTP_SMALL_ROWS=0"
        return
    if platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"):
        _reason = f"needs Linux on x86-64 (this is {platform.system()} on {platform.machine()})"
        return
    missing = {"avx2", "fma"} - _cpu_flags()
    if missing:
        _reason = f"this CPU lacks {', '.join(sorted(missing))}"
        return
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        _reason = "no C compiler (cc/gcc) on PATH to build runtime/csrc/small_rows.c"
        return
    try:
        lib = ctypes.CDLL(str(_build(compiler)))
        lib.small_rows_matmul, lib.small_rows_rms_norm, lib.small_rows_attention  # noqa: B018 - all there?
    except (OSError, RuntimeError, AttributeError) as err:
        _reason = f"could not build or load the kernel: {err}"
        warnings.warn(f"EntMTP small-row kernel unavailable, using torch's products: {_reason}", stacklevel=3)
        return
    fn = lib.small_rows_matmul
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                   ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int]
    fn.restype = None
    norm = lib.small_rows_rms_norm
    norm.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_float]
    norm.restype = None
    attend = lib.small_rows_attention
    attend.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 2 + [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 5 \
        + [ctypes.c_float, ctypes.c_int]
    attend.restype = None
    lib.small_rows_use_avx512.argtypes = [ctypes.c_int]
    lib.small_rows_use_avx512.restype = ctypes.c_int
    _lib = lib
    # bit-identical either way (see small_rows.c); avx2 is there to check that, or to compare speed
    wanted = os.environ.get("ENTMTP_SMALL_ROWS_ISA", "auto")
    try:
        set_isa(wanted)
    except ValueError as err:
        raise ValueError(f"ENTMTP_SMALL_ROWS_ISA={wanted!r}: {err}; unset it or use auto") from None


def available() -> bool:
    """Whether `matmul` can run here (builds the kernel on the first call)."""
    if not _probed:
        _load()
    return _lib is not None


def unavailable_reason() -> str | None:
    """Why `available()` is False (None when it is True)."""
    available()
    return _reason


def set_isa(name: str) -> str:
    """Pick the products' instruction set: "auto" (AVX-512 where the CPU has it), "avx512"
    (refused where the CPU lacks it) or "avx2".
    Returns the one in use. Results are bit-identical either way; only the speed differs."""
    if name not in ("auto", "avx2", "avx512"):
        raise ValueError(f"instruction set must be auto, avx2 or avx512, got {name!r}")
    assert _lib is not None, "small_rows.set_isa called where available() is False"
    wide = _lib.small_rows_use_avx512(0 if name == "avx2" else 1)
    if name == "avx512" and not wide:
        raise ValueError("this CPU has no AVX-512 (avx512f)")
    return "avx512" if wide else "avx2"


def isa() -> str | None:
    """The instruction set the products use ("avx512" or "avx2"), None where unavailable."""
    if not available():
        return None
    assert _lib is not None
    return "avx512" if _lib.small_rows_use_avx512(-1) else "avx2"


def pack(weight: Tensor) -> Tensor:
    """W [N, K] float32 as panels [ceil(N/16), K, 16] (output rows past N are zero)."""
    if weight.dim() != 2 or weight.dtype != torch.float32 or weight.device.type != "cpu":
        raise ValueError(f"pack takes a 2-D float32 CPU weight, got {tuple(weight.shape)} {weight.dtype} on {weight.device}")
    n, k = weight.shape
    padded = -(-n // PANEL) * PANEL
    w = weight.detach()
    if padded != n:
        w = torch.cat([w, w.new_zeros(padded - n, k)])
    return w.view(padded // PANEL, PANEL, k).transpose(1, 2).contiguous()


def matmul(x: Tensor, packed: Tensor, out_features: int) -> Tensor:
    """x [R, K] @ W^T for W packed by `pack`: [R, out_features] float32. Each row's result is
    bit-identical whatever R is. Call only when `available()`."""
    if x.dtype != torch.float32 or x.dim() != 2 or x.shape[1] != packed.shape[1]:
        raise ValueError(f"x must be float32 [R, {packed.shape[1]}], got {x.dtype} {tuple(x.shape)}")
    assert _lib is not None, "small_rows.matmul called where available() is False"
    x = x.contiguous()
    n_padded = packed.shape[0] * PANEL
    y = torch.empty(x.shape[0], n_padded, dtype=torch.float32)
    _lib.small_rows_matmul(x.data_ptr(), packed.data_ptr(), y.data_ptr(),
                           x.shape[0], x.shape[1], n_padded, torch.get_num_threads())
    return y if n_padded == out_features else y[:, :out_features]


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm over the last dimension of float32 x [..., D] (no autograd). Each row's result is
    bit-identical whatever the row count. Call only when `available()`."""
    if x.dtype != torch.float32 or weight.dtype != torch.float32 or x.shape[-1] != weight.shape[0]:
        raise ValueError(f"rms_norm takes float32 x [..., {weight.shape[0]}] and weight, got {x.dtype} {tuple(x.shape)}")
    assert _lib is not None, "small_rows.rms_norm called where available() is False"
    x = x.contiguous()
    y = torch.empty_like(x)
    d = x.shape[-1]
    _lib.small_rows_rms_norm(x.data_ptr(), weight.data_ptr(), y.data_ptr(), x.numel() // d, d, eps)
    return y


def attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, prefix: int, offsets: Tensor, slots: Tensor,
              longest: int, scale: float) -> Tensor:
    """Softmax attention of float32 query rows q [R, H, D], row r over the cache slots 0..prefix-1
    and then slots[offsets[r]:offsets[r+1]] (int64, in that order), of one layer's caches k_cache,
    v_cache [KVH, S, D] (contiguous; query head h reads KV head h // (H // KVH)). `longest`: the
    longest of those lists. Returns [R, H, D]. Each row's result depends only on its query and its
    keys in that order, not on R or on where the keys sit (see small_rows.c). Call only when
    `available()`."""
    assert _lib is not None, "small_rows.attention called where available() is False"
    r, h, d = q.shape
    kvh, s, _ = k_cache.shape
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()) or q.dtype != torch.float32 or k_cache.dtype != torch.float32:
        raise ValueError("attention takes float32 queries and contiguous float32 caches [KVH, S, D]")
    q = q.contiguous()
    out = torch.empty_like(q)
    scores = torch.empty(r * h * (prefix + longest), dtype=torch.float32)
    _lib.small_rows_attention(q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), s, prefix,
                              offsets.data_ptr(), slots.data_ptr(), out.data_ptr(), scores.data_ptr(),
                              r, h, kvh, d, longest, scale, torch.get_num_threads())
    return out
