"""The float32 arithmetic of a decode step's few rows on x86-64 CPUs with AVX2 + FMA: the product
y = x W^T, RMSNorm, and attention over each row's own list of cache slots. The product runs
AVX-512 where the CPU has it (bit-identical results, 1.3-1.5x faster; `set_isa`, or
`ENTMTP_SMALL_ROWS_ISA=avx2` to compare).

Why it exists: on a CPU a decode step is bound by reading the weights, so verifying a tree of R
tokens should cost about one token's forward. torch's BLAS (MKL) re-reads or repacks the weights
for 2..32 rows; on a 2-core AVX2 EPYC a 3-token forward cost 1.5x a one-token forward with it and
~1.1x with this kernel, and the one-token forward itself got ~1.4x faster. See
`runtime/model/csrc/small_rows.c` for the kernels and why each row's result does not depend on how many
rows the call holds or where its keys sit in the cache: with all three, every decode forward is
row-invariant by construction, so the exact lossless mode costs nothing extra.

How it is built: the install compiles `runtime/model/csrc/small_rows.c` as an optional setuptools
extension (`setup.py`; `make install` or `pip install [-e] .`) into `runtime/model/_small_rows*.so`
(next to this file: in the source tree for an editable install, in site-packages otherwise),
with the sha256 of the source it was compiled from embedded. This module finds that file with
importlib and loads it with ctypes (it is a plain C library, not a Python module). Nothing is
compiled at run time. A build whose embedded digest differs from the installed
`csrc/small_rows.c` (the source was edited, or pulled, without a reinstall) is stale and refused:
its arithmetic is not the source's.

Fallback: where the kernel cannot be used (no AVX2/FMA, not Linux x86-64, no C compiler at install
time, a stale build, `ENTMTP_SMALL_ROWS=0`) `available()` is False, `runtime.model.Linear` keeps
torch's products, and `unavailable_reason()` says why. The two give different float32 results, so
`kernel_id()` names the arithmetic that runs ("none" for torch's): stage keys and bank provenance
record it.
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib.util
import os
import platform
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import Tensor

PANEL = 16  # output rows per packed panel (the kernel's register tile is 6 rows x 16 outputs)
_SOURCE = Path(__file__).parent / "csrc" / "small_rows.c"
_EXTENSION = f"{__package__ or 'runtime.model'}._small_rows"  # built by setup.py at install time
_REINSTALL = "make install, or pip install [-e] ."

_lib: ctypes.CDLL | None = None
_reason: str | None = None  # why the kernel is unavailable; None = not probed yet or available
_source_sha: str | None = None  # sha256 of the source the loaded kernel was built from
_probed = False


def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _built_library() -> str | None:
    """The path of the kernel the install built, None where it did not."""
    try:
        spec = importlib.util.find_spec(_EXTENSION)
    except (ImportError, ValueError):
        return None
    return spec.origin if spec is not None and spec.origin and os.path.exists(spec.origin) else None


def _load() -> None:
    global _lib, _reason, _source_sha, _probed
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
    path = _built_library()
    if path is None:
        _reason = (f"{_EXTENSION.replace('.', '/')}*.so was not built at install time (no C compiler?): "
                   f"reinstall with a C compiler ({_REINSTALL})")
        return
    try:
        lib = ctypes.CDLL(path)
        lib.small_rows_matmul, lib.small_rows_rms_norm, lib.small_rows_attention  # noqa: B018 - all there?
        lib.small_rows_source_sha.argtypes = []
        lib.small_rows_source_sha.restype = ctypes.c_char_p
        built = lib.small_rows_source_sha().decode()
    except (OSError, AttributeError) as err:
        _reason = f"could not load the kernel {path}: {err}; reinstall to rebuild it ({_REINSTALL})"
        warnings.warn(f"EntMTP small-row kernel unavailable, using torch's products: {_reason}", stacklevel=3)
        return
    try:
        source = hashlib.sha256(_SOURCE.read_bytes()).hexdigest()
    except OSError as err:
        _reason = f"cannot check the kernel {path} against its source {_SOURCE}: {err}; reinstall ({_REINSTALL})"
        return
    if built != source:
        _reason = (f"stale build: {path} was compiled from another version of {_SOURCE} (sha256 {built[:12]}, "
                   f"the source now {source[:12]}); reinstall to rebuild it ({_REINSTALL})")
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
    _lib, _source_sha = lib, source
    # bit-identical either way (see small_rows.c); avx2 is there to check that, or to compare speed
    wanted = os.environ.get("ENTMTP_SMALL_ROWS_ISA", "auto")
    try:
        set_isa(wanted)
    except ValueError as err:
        raise ValueError(f"ENTMTP_SMALL_ROWS_ISA={wanted!r}: {err}; unset it or use auto") from None


def available() -> bool:
    """Whether `matmul` can run here (loads the kernel on the first call)."""
    if not _probed:
        _load()
    return _lib is not None


def unavailable_reason() -> str | None:
    """Why `available()` is False (None when it is True)."""
    available()
    return _reason


def kernel_id() -> str:
    """The name of the float32 arithmetic a decode forward runs here: "none" where the kernel is
    unavailable (torch's products), else "small_rows-<isa>-<first 12 hex digits of the source's
    sha256>", e.g. "small_rows-avx512-0123456789ab". The kernel and torch round differently, and a
    kernel built from another source may too, so whatever depends on decode arithmetic (stage keys,
    bank provenance) records this. The ISA part is the one in use now (`set_isa`); AVX-512 and AVX2
    are bit-identical by construction, and the name keeps which one ran."""
    if not available():
        return "none"
    assert _source_sha is not None
    return f"small_rows-{isa()}-{_source_sha[:12]}"


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
    import torch  # here, not at the top: `kernel_id` serves torch-free up-to-date checks

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
    import torch  # here, not at the top: `kernel_id` serves torch-free up-to-date checks

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
    import torch  # here, not at the top: `kernel_id` serves torch-free up-to-date checks

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
    import torch  # here, not at the top: `kernel_id` serves torch-free up-to-date checks

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
