"""The small-row CPU kernel (runtime.model.small_rows): right products and norms, each row's result
independent of the row count, runtime.model using it only where it applies, and the kernel built at
install time: its identity (`kernel_id`), a stale build refused, a missing one explained."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from pipeline.paths import REPO_ROOT
from runtime.model import llama as model_mod
from runtime.model import small_rows

needs_kernel = pytest.mark.skipif(not small_rows.available(),
                                  reason=f"small-row kernel unavailable: {small_rows.unavailable_reason()}")


# K not a multiple of the kernel's k block (64) or of 8; N not a multiple of the 16-row panel
@needs_kernel
@pytest.mark.parametrize("n_out,k_in", [(48, 64), (100, 37), (16, 200), (33, 576)])
def test_product_matches_torch_and_each_row_ignores_the_row_count(n_out: int, k_in: int) -> None:
    g = torch.Generator().manual_seed(n_out * k_in)
    w = torch.randn(n_out, k_in, generator=g)
    packed = small_rows.pack(w)
    assert packed.shape == (-(-n_out // 16), k_in, 16)
    x = torch.randn(13, k_in, generator=g)
    y = small_rows.matmul(x, packed, n_out)
    assert y.shape == (13, n_out)
    # against float64: float32 BLAS itself is 1e-5 off at k=576 (its blocking depends on the CPU)
    torch.testing.assert_close(y.double(), x.double() @ w.double().t(), rtol=1e-5, atol=1e-5)
    singles = [small_rows.matmul(x[i:i + 1], packed, n_out) for i in range(13)]
    for rows in range(1, 14):  # every row count, so every micro-kernel and remainder path runs
        got = small_rows.matmul(x[:rows], packed, n_out)
        for i in range(rows):
            assert torch.equal(got[i:i + 1], singles[i]), (rows, i)


@needs_kernel
@pytest.mark.skipif(small_rows.available() and "avx512f" not in small_rows._cpu_flags(), reason="no AVX-512 here")
def test_avx512_products_are_bit_identical_to_avx2() -> None:
    # 7 and 3 panels: the odd last panel takes the AVX2 kernel; 1..30 rows: every wide micro-kernel
    g = torch.Generator().manual_seed(1)
    try:
        for n_out, k_in in [(100, 37), (48, 130), (64, 576)]:
            packed = small_rows.pack(torch.randn(n_out, k_in, generator=g))
            x = torch.randn(30, k_in, generator=g)
            for rows in range(1, 31):
                assert small_rows.set_isa("avx2") == "avx2"
                narrow = small_rows.matmul(x[:rows], packed, n_out)
                assert small_rows.set_isa("avx512") == "avx512" and small_rows.isa() == "avx512"
                assert torch.equal(small_rows.matmul(x[:rows], packed, n_out), narrow), (n_out, k_in, rows)
    finally:
        small_rows.set_isa("auto")
    with pytest.raises(ValueError, match="auto, avx2 or avx512"):
        small_rows.set_isa("sse")


@needs_kernel
def test_rms_norm_matches_torch_and_each_row_ignores_the_row_count() -> None:
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(2, 5, 77, generator=g), torch.randn(77, generator=g)
    y = small_rows.rms_norm(x, w, 1e-5)
    torch.testing.assert_close(y, F.rms_norm(x, (77,), w, 1e-5), rtol=1e-5, atol=1e-6)
    assert torch.equal(y[1, 3], small_rows.rms_norm(x[1, 3:4], w, 1e-5)[0])


@needs_kernel
def test_wrong_inputs_are_refused_with_what_was_given() -> None:
    packed = small_rows.pack(torch.randn(16, 8))
    with pytest.raises(ValueError, match="float32"):
        small_rows.matmul(torch.randn(2, 8, dtype=torch.float64), packed, 16)
    with pytest.raises(ValueError, match=r"\[R, 8\]"):
        small_rows.matmul(torch.randn(2, 9), packed, 16)
    with pytest.raises(ValueError, match="2-D float32 CPU"):
        small_rows.pack(torch.randn(16, 8).to(torch.bfloat16))


@needs_kernel
def test_linear_uses_the_kernel_for_inference_and_torch_under_autograd() -> None:
    torch.manual_seed(0)
    lin = model_mod.Linear(40, 24, bias=True)
    x = torch.randn(5, 40)
    want = F.linear(x, lin.weight, lin.bias)
    lin.add_fast_paths()
    assert lin.weight_packed is not None and lin.weight_t is None
    with torch.no_grad():
        fast = lin(x)
        torch.testing.assert_close(fast, want, rtol=1e-5, atol=1e-5)
        assert torch.equal(fast[2:3], lin(x[2:3]))
    # a trainable weight with grad on: the kernel has no backward, so torch's product runs
    y = lin(x)
    y.sum().backward()
    assert lin.weight.grad is not None and lin.weight.grad.shape == (24, 40)
    bf16 = model_mod.Linear(40, 24, bias=False).to(torch.bfloat16)
    bf16.add_fast_paths()  # not float32: nothing to pack
    assert bf16.weight_packed is None and bf16.weight_t is None


def test_a_disabled_kernel_says_why_and_linear_falls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ENTMTP_SMALL_ROWS", "0")
    monkeypatch.setattr(small_rows, "_probed", False)
    monkeypatch.setattr(small_rows, "_lib", None)
    monkeypatch.setattr(small_rows, "_reason", None)
    assert not small_rows.available()
    assert "ENTMTP_SMALL_ROWS=0" in (small_rows.unavailable_reason() or "")
    lin = model_mod.Linear(40, 24, bias=False)
    lin.add_fast_paths()
    assert lin.weight_packed is None and lin.weight_t is not None
    x = torch.randn(3, 40)
    with torch.no_grad():
        torch.testing.assert_close(lin(x), F.linear(x, lin.weight), rtol=1e-5, atol=1e-5)


# (head dim, committed slots): the kernel scores 8 keys per pass and keeps 64 output lanes in
# registers, with scalar tails for what is left (a head dim not a multiple of 8, a list of < 8 keys)
@needs_kernel
@pytest.mark.parametrize("dim,prefix", [(24, 13), (64, 29), (60, 21), (128, 37)])
def test_attention_matches_softmax_and_ignores_row_count_and_key_placement(dim: int, prefix: int) -> None:
    g = torch.Generator().manual_seed(1)
    heads, kv_heads, slots_total = 6, 2, prefix + 27
    k, v = torch.randn(kv_heads, slots_total, dim, generator=g), torch.randn(kv_heads, slots_total, dim, generator=g)
    tree = [[0], [0, 1], [0, 2], [0, 1, 3]]  # a small tree after the committed slots
    lists = [[prefix + j for j in a] for a in tree]
    offsets = torch.tensor([0] + [len(a) for a in lists]).cumsum(0)
    slots = torch.tensor([j for a in lists for j in a])
    q = torch.randn(len(lists), heads, dim, generator=g)
    out = small_rows.attention(q, k, v, prefix, offsets, slots, 3, dim ** -0.5)
    for r, own in enumerate(lists):
        keys = list(range(prefix)) + own
        for h in range(heads):
            kh, vh = k[h // (heads // kv_heads), keys], v[h // (heads // kv_heads), keys]
            want = torch.softmax(q[r, h] @ kh.t() * dim ** -0.5, -1) @ vh
            torch.testing.assert_close(out[r, h], want, rtol=1e-5, atol=1e-6)
    # the last row alone, and with its own keys moved to other slots (as AR holds them): bit-identical
    alone = small_rows.attention(q[3:], k, v, prefix, torch.tensor([0, 3]), slots[offsets[3]:], 3, dim ** -0.5)
    assert torch.equal(alone[0], out[3])
    k2, v2 = k.clone(), v.clone()
    moved_to = [slots_total - 3, slots_total - 2, slots_total - 1]
    k2[:, moved_to], v2[:, moved_to] = k[:, lists[3]], v[:, lists[3]]
    moved = small_rows.attention(q[3:], k2, v2, prefix, torch.tensor([0, 3]), torch.tensor(moved_to), 3, dim ** -0.5)
    assert torch.equal(moved[0], out[3])


def _fresh(code: str, **env: str) -> str:
    """Run `code` in a fresh interpreter (fresh module state) and return what it printed."""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={**os.environ, **env},
                          cwd=REPO_ROOT, timeout=120)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def _reset_probe(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in [("_probed", False), ("_lib", None), ("_reason", None), ("_source_sha", None)]:
        monkeypatch.setattr(small_rows, name, value)


def test_kernel_id_is_none_when_disabled_and_names_the_isa_and_source_otherwise() -> None:
    kid, reason = _fresh("from runtime.model import small_rows as s; print(s.kernel_id()); print(s.unavailable_reason())",
                         ENTMTP_SMALL_ROWS="0").splitlines()
    assert kid == "none" and "ENTMTP_SMALL_ROWS=0" in reason
    if not small_rows.available():
        assert small_rows.kernel_id() == "none"
        return
    sha = hashlib.sha256(small_rows._SOURCE.read_bytes()).hexdigest()
    assert small_rows.kernel_id() == f"small_rows-{small_rows.isa()}-{sha[:12]}"
    try:
        small_rows.set_isa("avx2")
        assert small_rows.kernel_id() == f"small_rows-avx2-{sha[:12]}"
    finally:
        small_rows.set_isa("auto")
    assert _fresh("from runtime.model import small_rows as s; print(s.kernel_id())", ENTMTP_SMALL_ROWS_ISA="avx2") \
        == f"small_rows-avx2-{sha[:12]}"


@needs_kernel
def test_a_build_older_than_its_source_is_refused(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    edited = tmp_path / "small_rows.c"  # the source as if edited (or pulled) after the install built the kernel
    edited.write_bytes(small_rows._SOURCE.read_bytes() + b"\n/* edited */\n")
    monkeypatch.setattr(small_rows, "_SOURCE", edited)
    _reset_probe(monkeypatch)
    with pytest.warns(UserWarning, match="stale build"):
        assert not small_rows.available()
    reason = small_rows.unavailable_reason() or ""
    assert "stale build" in reason and "reinstall" in reason and "make install" in reason, reason
    assert small_rows.kernel_id() == "none"
    lin = model_mod.Linear(16, 8, bias=False)
    lin.add_fast_paths()
    assert lin.weight_packed is None  # torch's products


def test_a_kernel_not_built_at_install_says_how_to_get_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ENTMTP_SMALL_ROWS", raising=False)
    monkeypatch.setattr(small_rows, "_EXTENSION", "runtime._no_such_kernel")
    monkeypatch.setattr(small_rows, "_cpu_flags", lambda: {"avx2", "fma"})
    monkeypatch.setattr(small_rows.platform, "system", lambda: "Linux")
    monkeypatch.setattr(small_rows.platform, "machine", lambda: "x86_64")
    _reset_probe(monkeypatch)
    assert not small_rows.available() and small_rows.kernel_id() == "none"
    reason = small_rows.unavailable_reason() or ""
    assert "runtime/_no_such_kernel*.so was not built at install time" in reason and "C compiler" in reason, reason
