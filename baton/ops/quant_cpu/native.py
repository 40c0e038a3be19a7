"""Build and load ``kernels.c`` (the fast CPU path of baton.ops.quant_cpu) with the system C compiler, once per
machine: the shared library is cached in ``baton.env.cache_dir() / "kernels"`` under a key of the source, the
compiler, its flags and the CPU, so a second process only loads it (milliseconds; the first build takes a few
seconds). ``-march=native`` is used where the compiler takes it. The kernels run on a thread pool of their own
(kernels.c); ``sync_threads`` sizes it to ``torch.get_num_threads()`` (baton sets that from
``baton.env.num_threads()`` when it loads a GGUF on the CPU).

``lib()`` returns the loaded library, or None where no C compiler is found or the build fails (the callers then
take the plain-PyTorch references, or the loader keeps the dequantised fp32 model: baton.models.build).
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

from baton import env

log = logging.getLogger(__name__)
SOURCE = Path(__file__).with_name("kernels.c")
VARIANTS = {"native": (), "avx2": ("-DBQ_NO_AVX512",), "portable": ("-DBQ_NO_AVX512", "-DBQ_NO_AVX2")}
ISA_NAMES = {3: "avx512", 2: "avx2", 0: "portable"}

_lock = threading.Lock()
_libs: dict[str, ctypes.CDLL | None] = {}
_errors: dict[str, str] = {}

P, I32, I64, F32 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_float


class LayerArgs(ctypes.Structure):
    """``bq_layer`` of kernels.c: a Llama decoder layer's shapes and weight pointers."""

    _fields_ = [("hidden", I32), ("heads", I32), ("kv_heads", I32), ("head_dim", I32), ("inter", I32),
                ("eps_in", F32), ("eps_post", F32), ("scale", F32),
                ("norm_in", P), ("norm_post", P), ("inv_freq", P), ("qkv", P), ("o", P), ("gu", P), ("dn", P)]


_SIGNATURES = {
    "bq_version": ([], I32), "bq_isa": ([], I32), "bq_set_threads": ([I32], I32), "bq_threads": ([], I32),
    "bq_q4_1_linear": ([P, I32, I32, P, I32, P, P], I32),
    "bq_q8_0_linear": ([P, I32, I32, P, I32, P], I32),
    "bq_q4_1_dequant": ([P, I32, I32, P], None),
    "bq_q8_0_dequant": ([P, I32, I32, P], None),
    "bq_q8_0_rows": ([P, I32, P, I32, I32, P], I32),
    "bq_layer_scratch": ([ctypes.POINTER(LayerArgs), I32, I32], I64),
    "bq_llama_layer": ([ctypes.POINTER(LayerArgs), P, P, I32, P, P, P, I32, P], I32),
    "bq_llama_stack": ([ctypes.POINTER(LayerArgs), I32, P, P, I32, P, P, P, I32, P, P, P, P, F32], I32),
    "bq_argmax_rows": ([P, I32, I64, P], None),
    "bq_profile": ([I32], None),
    "bq_profile_entry": ([I32, ctypes.POINTER(I64), ctypes.POINTER(I64)], ctypes.c_char_p),
}


def _compilers() -> list[str]:
    return [p for p in (shutil.which(c) for c in ("cc", "gcc", "clang")) if p]


def _cpu_signature() -> str:
    """What -march=native depends on: the CPU's model and flags (Linux), else the platform's name for it."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [ln for ln in f if ln.startswith(("model name", "flags", "Features", "CPU part"))]
        return "".join(sorted(set(lines)))
    except OSError:
        return platform.processor() + platform.machine()


def _version(cc: str) -> str:
    try:
        return subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def _build(variant: str, src: Path = SOURCE) -> ctypes.CDLL:
    """kernels.c (or another copy of it at ``src``: benchmarks/bench_quant_cpu_rows.py's baseline) built as
    ``variant``, cached under a key of the source, the compiler, its flags and the CPU."""
    compilers = _compilers()
    if not compilers:
        raise RuntimeError("no C compiler (cc, gcc or clang) on PATH")
    source = src.read_bytes()
    cache = env.cache_dir() / "kernels"
    try:
        cache.mkdir(parents=True, exist_ok=True)
        if not os.access(cache, os.W_OK):
            raise PermissionError(str(cache))
    except OSError:  # a read-only home: a private temporary directory instead
        cache = Path(tempfile.gettempdir()) / f"baton-kernels-{os.getuid() if hasattr(os, 'getuid') else 'user'}"
        cache.mkdir(mode=0o700, parents=True, exist_ok=True)
    errors = []
    for cc in compilers:
        version = _version(cc)
        for extra in (["-march=native"], []):
            flags = ["-O3", "-std=gnu11", "-fPIC", "-shared", "-pthread", *extra, *VARIANTS[variant]]
            key = hashlib.sha256(b"\0".join([source, cc.encode(), version.encode(), " ".join(flags).encode(),
                                             _cpu_signature().encode()])).hexdigest()[:20]
            path = cache / f"quant_cpu-{variant}-{key}.so"
            if not path.exists():
                fd, tmp = tempfile.mkstemp(suffix=".so", dir=cache)
                os.close(fd)
                try:
                    proc = subprocess.run([cc, *flags, str(src), "-o", tmp, "-lm", "-lpthread"], capture_output=True,
                                          text=True, timeout=300)
                    if proc.returncode != 0:
                        errors.append(f"{cc} {' '.join(extra)}: {proc.stderr.strip().splitlines()[-1:]}")
                        continue
                    os.replace(tmp, path)  # atomic: concurrent processes see the whole file or none
                    log.info("built the quantized CPU kernels (%s, %s): %s", variant, " ".join(extra), path)
                finally:
                    if os.path.exists(tmp):
                        os.unlink(tmp)
            try:
                lib = ctypes.CDLL(str(path))
            except OSError as e:
                errors.append(f"{path}: {e}")
                continue
            for name, (args, res) in _SIGNATURES.items():
                fn = getattr(lib, name)
                fn.argtypes, fn.restype = args, res
            lib.variant, lib.flags = variant, flags
            return lib
    raise RuntimeError("; ".join(errors))


def lib(variant: str = "native") -> ctypes.CDLL | None:
    """The kernels (built or loaded once per process), None where they cannot be built here (the reason is logged
    once and kept in ``error()``)."""
    got = _libs.get(variant, False)
    if got is not False:
        return got
    with _lock:
        if variant not in _libs:
            try:
                _libs[variant] = _build(variant)
            except Exception as e:  # noqa: BLE001 - no compiler, a failed build: the references take over
                _libs[variant] = None
                _errors[variant] = f"{type(e).__name__}: {e}"
                log.warning("quantized CPU kernels unavailable (%s); using the PyTorch references", _errors[variant])
        return _libs[variant]


_threads: dict[str, int] = {}


def sync_threads(lib_: ctypes.CDLL) -> int:
    """Size the kernels' thread pool to ``torch.get_num_threads()`` (a no-op when it already is)."""
    n = torch.get_num_threads()
    if _threads.get(lib_.variant) != n:
        _threads[lib_.variant] = lib_.bq_set_threads(n)
    return n


def traced(name: str):
    """A torch.profiler range named ``name`` around a kernel call while the profiler runs (else a no-op)."""
    if torch.autograd._profiler_enabled():
        return torch.autograd.profiler.record_function(name)
    return contextlib.nullcontext()


def profile(on: bool, variant: str = "native") -> list[tuple[str, float, int]]:
    """Start (on) or stop the kernels' own per-phase profile; returns [(phase, ms, calls)] accumulated so far
    (wall time on the calling thread: torch.profiler does not see inside a ctypes call)."""
    lib_ = lib(variant)
    if lib_ is None:
        return []
    rows, i = [], 0
    ns, calls = I64(), I64()
    while (name := lib_.bq_profile_entry(i, ctypes.byref(ns), ctypes.byref(calls))) is not None:
        rows.append((name.decode(), ns.value / 1e6, calls.value))
        i += 1
    lib_.bq_profile(1 if on else 0)
    return rows


def error(variant: str = "native") -> str | None:
    return _errors.get(variant)


def isa(variant: str = "native") -> str | None:
    """"avx512", "avx2" or "portable": the code path the loaded library runs; None when it is unavailable."""
    lib_ = lib(variant)
    return None if lib_ is None else ISA_NAMES.get(lib_.bq_isa(), "?")
