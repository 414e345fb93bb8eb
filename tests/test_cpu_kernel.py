"""tuichat's bf16 linear, in the build for this CPU (AMX here) and in an AVX2 build: exact to bf16 rounding
against a float32 reference, a row's result independent of its batch, used by the engine, and a clear
fallback when it cannot be built or is switched off."""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import CPU_BUILDS, RUNS_ON, cannot_run, make_tiny, no_kernels
from tuichat.engine.cpu import build, native
from tuichat.engine.engine import Engine, EngineConfig
from tuichat.engine.runner import StepChunk


@pytest.fixture
def fresh_load():
    build.load.cache_clear()
    yield build.load
    build.load.cache_clear()


@pytest.fixture(params=list(CPU_BUILDS))
def kernels(request, fresh_load, monkeypatch):
    """This CPU's build and the others of CPU_BUILDS that it can run."""
    if not CPU_BUILDS[request.param] <= build.cpu_flags():
        pytest.skip(cannot_run(request.param, build.cpu_flags()))
    monkeypatch.setenv("TUICHAT_CPU_ARCH", request.param)
    kernel, why = fresh_load()
    if kernel is None:
        pytest.skip(no_kernels(why))
    return kernel


@pytest.fixture
def amx(fresh_load):
    kernel, why = fresh_load()
    if kernel is None or kernel.isa != "amx":
        pytest.skip(f"no AMX here ({why}): runs on {RUNS_ON['amx']}")
    return kernel


def _ulps_off(y: torch.Tensor, exact: torch.Tensor, magnitude: torch.Tensor) -> torch.Tensor:
    """How many bf16 steps y is from the float32 result (bf16 has 8 significant bits), widened by the float32
    summation's own error bound (K * 2^-24 * sum |x w|), which matters only where terms cancel."""
    step = exact.abs().clamp_min(1e-30).log2().floor().exp2() / 128
    summation = magnitude * magnitude.new_tensor(2.0**-24)
    return ((y.float() - exact).abs() / (step + summation)).round()


@pytest.mark.parametrize("rows", [1, 3, 8, 16, 17, 40, 64, 65, 130, 512])
@pytest.mark.parametrize("out_features,in_features", [(16, 32), (48, 64), (96, 576), (320, 128)])
@pytest.mark.parametrize("with_bias", [False, True])
def test_kernel_is_exact_to_bf16_rounding(kernels, rows, out_features, in_features, with_bias):
    gen = torch.Generator().manual_seed(rows * 1000 + out_features)
    # x is a strided view (every other row of a wider tensor): the kernel must honour row strides.
    wide = torch.randn(rows * 2, in_features + 32, generator=gen).bfloat16()
    x = wide[::2, :in_features]
    weight = (torch.randn(out_features, in_features, generator=gen) * 0.05).bfloat16()
    bias = torch.randn(out_features, generator=gen).bfloat16() if with_bias else None
    assert kernels.fits(weight, bias)
    y = kernels(x, weight, bias)
    exact = x.float() @ weight.float().T + (bias.float() if bias is not None else 0)
    magnitude = in_features * (x.float().abs() @ weight.float().abs().T + (bias.float().abs() if bias is not None else 0))
    off = _ulps_off(y, exact, magnitude)
    assert y.shape == (rows, out_features) and y.dtype is torch.bfloat16
    assert off.max() <= 1  # only the fp32 summation order differs
    assert (off == 0).float().mean() >= 0.97
    torch_off = _ulps_off(F.linear(x, weight, bias), exact, magnitude)
    assert off.sum() <= torch_off.sum() + 0.02 * off.numel()  # no worse than torch's own kernel


def test_kernel_keeps_leading_dims(kernels):
    x = torch.randn(1, 5, 64).bfloat16()
    weight = torch.randn(32, 64).bfloat16()
    y = kernels(x, weight, None)
    assert y.shape == (1, 5, 32)
    torch.testing.assert_close(y.float(), F.linear(x, weight).float(), rtol=1 / 64, atol=1e-2)


def test_a_row_does_not_depend_on_its_batch(kernels):
    """Bit for bit: what keeps the C decoder's replies independent of batching (test_native.py)."""
    torch.manual_seed(0)
    x = torch.randn(300, 576).bfloat16()
    w = torch.randn(96, 576).mul(0.05).bfloat16()
    whole = kernels(x, w, None)
    for rows in (1, 17, 64, 65, 299):
        assert torch.equal(kernels(x[:rows], w, None), whole[:rows])
    assert torch.equal(kernels(x[200:201], w, None), whole[200:201])


def test_fits_only_what_the_kernel_handles():
    w = torch.zeros(32, 64, dtype=torch.bfloat16)
    assert native.CpuKernels.fits(w, None)
    assert not native.CpuKernels.fits(w.float(), None)
    assert not native.CpuKernels.fits(torch.zeros(32, 48, dtype=torch.bfloat16), None)  # K % 32
    assert not native.CpuKernels.fits(torch.zeros(40, 64, dtype=torch.bfloat16), None)  # N % 16
    assert not native.CpuKernels.fits(torch.zeros(64, 32, dtype=torch.bfloat16).T, None)  # not contiguous
    assert not native.CpuKernels.fits(w, torch.zeros(32))  # float32 bias


def test_transformers_layers_use_the_kernel_and_match_transformers(amx, monkeypatch):
    model, reference = make_tiny("llama")
    model, reference = model.to(torch.bfloat16), reference.to(torch.bfloat16)
    engine = Engine(model, config=EngineConfig(num_blocks=16))
    assert engine.matmul == "amx"
    engine.runner.native = None  # as for models decoder.c does not cover: transformers' layers, our matmul
    calls = []
    original = native.CpuKernels.__call__
    monkeypatch.setattr(native.CpuKernels, "__call__", lambda self, *a: calls.append(a[0].shape) or original(self, *a))
    prompts = [[5, 9, 23, 7, 81, 3], [17, 4, 4, 60]]
    tables = [[0], [1]]
    chunks = [StepChunk(p, 0, t, True) for p, t in zip(prompts, tables)]
    logits = engine.runner.execute(chunks)
    assert calls, "the kernel was not used for a 10-row step"
    with torch.inference_mode():
        for row, prompt in zip(logits, prompts):
            expected = reference(torch.tensor([prompt])).logits[0, -1].float()
            torch.testing.assert_close(row, expected, rtol=0.05, atol=0.05)
    # One decode row each, batched: two rows through the kernel.
    calls.clear()
    nexts = [int(row.argmax()) for row in logits]
    logits = engine.runner.execute([StepChunk([n], len(p), t, True) for n, p, t in zip(nexts, prompts, tables)])
    assert calls and all(shape[-2] == 2 for shape in calls if len(shape) > 1)
    with torch.inference_mode():
        for row, prompt, n in zip(logits, prompts, nexts):
            expected = reference(torch.tensor([prompt + [n]])).logits[0, -1].float()
            torch.testing.assert_close(row, expected, rtol=0.05, atol=0.05)
    engine.close()


def test_switched_off_by_environment(fresh_load, monkeypatch):
    monkeypatch.setenv("TUICHAT_CPU_KERNELS", "0")
    kernel, why = fresh_load()
    assert kernel is None and "TUICHAT_CPU_KERNELS" in why
    model, _ = make_tiny("llama")
    engine = Engine(model.to(torch.bfloat16), config=EngineConfig(num_blocks=8))
    assert engine.matmul.startswith("off")
    engine.close()


def test_failed_build_falls_back_to_torch_with_a_reason(fresh_load, monkeypatch, tmp_path):
    monkeypatch.setenv("TUICHAT_CACHE_DIR", str(tmp_path))  # no kernel built before
    monkeypatch.setenv("CC", "false")
    kernel, why = fresh_load()
    assert kernel is None and "build failed" in why


def test_a_missing_compiler_named_by_cc_falls_back_with_its_name(fresh_load, monkeypatch, tmp_path):
    monkeypatch.setenv("TUICHAT_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    assert not build.build_pending()  # nothing to build with: no progress promised
    kernel, why = fresh_load()
    assert kernel is None and "no-such-cc" in why and "not an executable" in why
    assert not build.available()


def test_a_failed_compile_says_its_error_lines(fresh_load, monkeypatch, tmp_path):
    """The message keeps what the compiler said was wrong, not its last line (often "compilation terminated")."""
    cc = tmp_path / "cc"
    cc.write_text("#!/bin/sh\n[ \"$1\" = --version ] && { echo fake 1.0; exit 0; }\n"
                  "echo 'decoder.c:12:3: error: unknown type name vf' >&2\necho 'compilation terminated.' >&2\nexit 1\n")
    cc.chmod(0o755)
    monkeypatch.setenv("TUICHAT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("CC", str(cc))
    kernel, why = fresh_load()
    assert kernel is None and "decoder.c:12:3: error: unknown type name vf" in why


def test_a_compile_that_hangs_is_given_up(fresh_load, monkeypatch, tmp_path):
    cc = tmp_path / "cc"
    cc.write_text("#!/bin/sh\n[ \"$1\" = --version ] && { echo fake 1.0; exit 0; }\nexec sleep 60\n")
    cc.chmod(0o755)
    monkeypatch.setenv("TUICHAT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("CC", str(cc))
    monkeypatch.setattr(build, "BUILD_TIMEOUT_S", 1)
    kernel, why = fresh_load()
    assert kernel is None and "took over 1 s" in why


def test_without_kernels_the_dtype_is_what_torch_runs_best(fresh_load, monkeypatch, tmp_path, session_cache):
    """A build that fails decides the dtype as having no kernels does: bf16 only where torch has native bf16."""
    from tuichat.engine import loader

    monkeypatch.setenv("TUICHAT_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", "false")
    monkeypatch.setattr(loader, "cpu_flags", lambda: set())  # a CPU without native bf16 dot products
    assert loader.resolve_dtype("auto", torch.device("cpu"), "llama") is torch.float32
    monkeypatch.delenv("CC")
    monkeypatch.setenv("TUICHAT_CACHE_DIR", str(session_cache))  # built there once for the whole session
    fresh_load.cache_clear()
    assert loader.resolve_dtype("auto", torch.device("cpu"), "llama") is torch.bfloat16


def test_a_first_build_is_announced(fresh_load, monkeypatch, tmp_path):
    """The first build takes seconds: the backend shows progress when build_pending() says one is coming (the
    test below sees it false once a build is done)."""
    monkeypatch.setenv("TUICHAT_CACHE_DIR", str(tmp_path))
    assert build.build_pending()


@pytest.fixture
def copied_build(fresh_load, session_cache, tmp_path, monkeypatch):
    """This CPU's build, copied (modes kept) out of the session cache into a cache of this test's own: the
    path of its library, not loaded from there yet."""
    kernel, why = fresh_load()  # built into the session cache once, then reused
    if kernel is None:
        pytest.skip(no_kernels(why))
    shutil.copytree(session_cache / "kernels", tmp_path / "cache" / "kernels")
    monkeypatch.setenv("TUICHAT_CACHE_DIR", str(tmp_path / "cache"))
    fresh_load.cache_clear()
    library = build._library_path(build._compiler(), build._flags())
    assert library.is_file() and not build.build_pending()  # the copy is trusted as it is
    return library


def mapped_from(folder: Path) -> list[str]:
    """The files under `folder` this process has mapped, as the kernel lists them ('... (deleted)' for a file
    replaced since it was mapped)."""
    return sorted({line.split(None, 5)[5] for line in Path("/proc/self/maps").read_text().splitlines()
                   if len(line.split(None, 5)) == 6 and line.split(None, 5)[5].startswith(str(folder))})


def assert_works(kernel) -> None:
    x, w = torch.randn(3, 64).bfloat16(), torch.randn(32, 64).bfloat16()
    torch.testing.assert_close(kernel(x, w, None).float(), F.linear(x, w).float(), rtol=1 / 64, atol=1e-2)


def test_a_tampered_library_is_rebuilt_private_under_a_permissive_umask_not_loaded(copied_build, fresh_load):
    """One rebuild (they take seconds) for two reasons to make one: the library is not what was built, and the
    kernels folder is one others could write (left so by someone, or an older tuichat). Under a umask that
    grants everyone everything, all the build writes is private."""
    with copied_build.open("ab") as library:
        library.write(b"\0")
    copied_build.parent.parent.chmod(0o777)
    tampered = copied_build.stat().st_ino
    assert build.build_pending()
    umask = os.umask(0)
    try:
        kernel, why = fresh_load()
    finally:
        os.umask(umask)
    assert kernel is not None, why
    assert copied_build.stat().st_ino != tampered
    assert (copied_build.parent / "cpu_kernels.so.sha256").read_text().strip() == sha256(copied_build)
    # What this process mapped is the new file; the tampered one never was (it would show as deleted).
    assert mapped_from(copied_build.parent.parent) == [str(copied_build)]
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in (copied_build.parent.parent, copied_build.parent,
                                                              copied_build, copied_build.parent / "cpu_kernels.so.sha256")}
    assert modes == {"kernels": 0o700, copied_build.parent.name: 0o700, "cpu_kernels.so": 0o700,
                     "cpu_kernels.so.sha256": 0o600}
    assert sorted(p.name for p in copied_build.parent.iterdir()) == ["cpu_kernels.so", "cpu_kernels.so.sha256"]
    build.load.cache_clear()
    assert not build.build_pending()  # on disk, trusted, for the next process
    assert_works(kernel)


def test_a_library_others_could_write_or_that_is_not_ours_is_not_trusted(copied_build):
    """build_pending() is load()'s own check: True means the next load rebuilds instead of loading."""
    changes = {
        "library group-writable": lambda: copied_build.chmod(0o720),
        "library world-writable": lambda: copied_build.chmod(0o702),
        "its folder group-writable": lambda: copied_build.parent.chmod(0o770),
        "the kernels folder world-writable": lambda: copied_build.parent.parent.chmod(0o707),
        "no recorded hash": lambda: (copied_build.parent / "cpu_kernels.so.sha256").unlink(),
    }
    if os.getuid() == 0:  # only root can give a file away
        changes["library owned by someone else"] = lambda: os.chown(copied_build, 65534, -1)
    for what, change in changes.items():
        saved = [(p, p.stat().st_mode, p.stat().st_uid) for p in (copied_build, copied_build.parent,
                                                                 copied_build.parent.parent)]
        digest = (copied_build.parent / "cpu_kernels.so.sha256").read_text()
        change()
        assert build.build_pending(), what
        for path, mode, uid in saved:
            os.chown(path, uid, -1)
            path.chmod(mode)
        (copied_build.parent / "cpu_kernels.so.sha256").write_text(digest)
        assert not build.build_pending(), f"{what}, undone"


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()
