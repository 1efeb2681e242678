"""Ahead-of-time compilation of every Triton kernel of gradscaler, as its launchers request it, for
real CUDA targets, on a machine with no GPU (run by ``tests/test_kernel_compile.py`` in a process of
its own: the test process runs Triton's interpreter, whose kernels cannot be compiled).

The launchers themselves are driven over every input class their tables define (each dtype of
``triton_stats.TRITON_DTYPES`` / ``triton_move.MOVE_DTYPES``, a norm type per ``triton_stats.MODES``,
with and without the inverse scale or factor, aligned and unaligned tensors, one tensor and several)
with the kernels replaced by recorders; each recorded launch goes through Triton's own binder (the
signature, constexprs, alignment attributes and options a launch on a GPU would compile) and is
compiled by ``triton.compile`` for each target through the bundled ptxas. Writes one JSON record per
(specialization, target) to the path given. The binder and argument packing are Triton's internals
(``create_function_from_signature``, ``JITFunction._pack_args``, as ``JITFunction.run`` uses them in
Triton 3.7.1, the release torch 2.13's CUDA build pins, and in 3.9): a Triton that changes them fails
this script loudly rather than compiling something else.

Usage: python tests/kernel_compile.py OUT.json --targets 70,75,80 [--sass 90] [--modes 1]
[--without-compile-options] (the last: launch as if ``triton_stats.COMPILE_OPTIONS`` were empty, to
show what the checks catch when the setting is removed).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import tempfile
import time
from typing import Any

if os.environ.get("TRITON_INTERPRET"):
    raise SystemExit("kernel_compile.py compiles kernels: run it without TRITON_INTERPRET.")

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.compiler.compiler import make_backend
from triton.runtime.jit import JITFunction, create_function_from_signature

from gradscaler.kernels import triton_move, triton_stats

MODULES = (triton_stats, triton_move)
NORM_TYPES = (None, 2.0, math.inf, 3.0)
"""One norm type per launch MODE; ``main`` checks that they reach every one of ``triton_stats.MODES``."""
# PTX arithmetic without a rounding modifier may be contracted into an FMA by LLVM or ptxas; with one
# (``mul.rn.f64``) it never is. Half-precision (f16/bf16) arithmetic is not matched: the kernels do none.
CONTRACTIBLE = re.compile(r"^\s*(?:mul|add|sub)(?:\.ftz)?(?:\.sat)?\.f(?:32|64)\b", re.MULTILINE)
FMA_PTX = re.compile(r"^\s*fma\.", re.MULTILINE)
FMA_SASS = re.compile(r"\b[DFH]FMA2?\b")
RUN_KNOBS = ("instrumentation_mode", "fpsan_homomorphic_casts")
"""The ``triton.knobs.compilation`` settings that ``JITFunction.run`` copies into a launch's keywords:
both in Triton 3.9, the first alone in 3.7.1. Each is read where this Triton has it, as its own
``run`` does."""


class Recorder:
    """Stands in for a kernel: records each launch (kernel, args, keyword arguments), runs nothing."""

    def __init__(self, fn: JITFunction, calls: list[tuple[JITFunction, tuple[Any, ...], dict[str, Any]]]) -> None:
        self.fn, self.calls = fn, calls

    def __getitem__(self, grid: object) -> Any:
        def launch(*args: Any, **kwargs: Any) -> None:
            self.calls.append((self.fn, args, dict(kwargs)))

        return launch


def kernels() -> dict[str, tuple[Any, JITFunction]]:
    """Every launchable kernel of the modules (module, name -> JITFunction): the ``*_kernel`` ones; the
    others (``locate``, ``accumulate``, ``nan_max``) are device functions they call."""
    found = {}
    for module in MODULES:
        for name, value in vars(module).items():
            if isinstance(value, JITFunction) and name.endswith("_kernel"):
                found[name] = (module, value)
    return found


def tensors(dtype: torch.dtype, count: int, aligned: bool) -> list[torch.Tensor]:
    """``count`` gradients (chunk edges: one spans two chunks); unaligned ones are views one value in."""
    shift = 0 if aligned else 1
    sizes = [triton_stats.CHUNK + 5, 3, 7][:count]
    return [torch.ones(n + shift, dtype=dtype)[shift:] for n in sizes]


def record_launches() -> list[tuple[JITFunction, tuple[Any, ...], dict[str, Any]]]:
    calls: list[tuple[JITFunction, tuple[Any, ...], dict[str, Any]]] = []
    for name, (module, fn) in kernels().items():
        setattr(module, name, Recorder(fn, calls))
    inv = torch.tensor(2.0**-10)
    for dtype in triton_stats.TRITON_DTYPES:
        for norm_type in NORM_TYPES:
            for inv_scale in (None, inv):
                for aligned in (True, False):
                    for count in (1, 3):
                        triton_stats.grad_stats(tensors(dtype, count, aligned), norm_type, inv_scale)
    for dtype in triton_move.MOVE_DTYPES:
        for norm_type in NORM_TYPES:
            for factor in (None, inv):
                for norm_inv in (None, inv):
                    for count in (1, 3):
                        src = tensors(dtype, count, True)
                        dst = [torch.empty(s.shape) for s in src]
                        triton_move.move_grads_(src, dst, factor, norm_type, norm_inv)
    for name, (module, fn) in kernels().items():
        setattr(module, name, fn)
    return calls


def specialize(fn: JITFunction, args: tuple[Any, ...], kwargs: dict[str, Any], capability: int) -> tuple[Any, ...]:
    """What ``JITFunction.run`` would compile for this launch on a device of ``capability``: Triton's own
    binder and argument packing (signature, constexprs, alignment attributes, parsed options)."""
    target = GPUTarget("cuda", capability, 32)
    backend = make_backend(target)
    kwargs = dict(kwargs, debug=kwargs.get("debug", fn.debug) or triton.knobs.runtime.debug)
    for knob in RUN_KNOBS:
        if hasattr(triton.knobs.compilation, knob):
            kwargs[knob] = getattr(triton.knobs.compilation, knob)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, options)
    return target, options, signature, constexprs, attrs


def describe(constexprs: dict[Any, Any], fn: JITFunction) -> dict[str, str]:
    return {fn.arg_names[path[0]]: str(value) for path, value in sorted(constexprs.items())}


def sass_fmas(cubin: bytes) -> int:
    """FMA instructions (any precision) in the machine code, read with the bundled cuobjdump."""
    tool = triton.knobs.nvidia.cuobjdump.path
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([tool, "-sass", f.name], check=True, capture_output=True, text=True).stdout
    return len(FMA_SASS.findall(sass))


def main(out: str, capabilities: list[int], sass_capability: int | None, modes: set[int] | None) -> None:
    """Compile for each of ``capabilities`` (the launches of ``modes`` only, when given); for
    ``sass_capability`` also count the FMAs in the machine code of the kernels that sum squares of
    products (``acc += y * y``: the chunk and move kernels in MODE_SQUARES; cuobjdump takes ~0.3 s a
    cubin, so on one target only). The second launch is left out there: its float64 ``sqrt.rn``
    becomes ptxas's correctly rounded sequence, made of FMAs."""
    calls = record_launches()
    launched = {fn.__name__ for fn, _, _ in calls}
    missing = set(kernels()) - launched
    if missing:
        raise SystemExit(f"kernels no launcher reached: {sorted(missing)}")
    launched_modes = {kwargs["MODE"] for fn, _, kwargs in calls if fn.__name__ != "_tensor_kernel"}
    if launched_modes != set(triton_stats.MODES):
        raise SystemExit(f"launch modes {sorted(launched_modes)} are not triton_stats.MODES {triton_stats.MODES}")
    records = []
    for capability in capabilities:
        seen = set()
        for fn, args, kwargs in calls:
            if modes is not None and kwargs["MODE"] not in modes:
                continue
            target, options, signature, constexprs, attrs = specialize(fn, args, kwargs, capability)
            key = (fn.__name__, repr(signature), repr(sorted(constexprs.items())), repr(attrs), options.hash())
            if key in seen:
                continue
            seen.add(key)
            start = time.perf_counter()
            compiled = triton.compile(
                ASTSource(fn, signature, constexprs, attrs), target=target, options=options.__dict__
            )
            seconds = time.perf_counter() - start
            ptx, cubin = compiled.asm["ptx"], compiled.asm.get("cubin", b"")
            squares = kwargs["MODE"] == triton_stats.MODE_SQUARES and fn.__name__ != "_tensor_kernel"
            records.append(
                {
                    "kernel": fn.__name__,
                    "capability": capability,
                    "constexprs": describe(constexprs, fn),
                    "signature": {k: str(v) for k, v in signature.items() if v != "constexpr"},
                    "launch_fp_fusion": kwargs.get("enable_fp_fusion"),
                    "enable_fp_fusion": options.enable_fp_fusion,
                    "cubin_bytes": len(cubin),
                    "ptx_fma": len(FMA_PTX.findall(ptx)),
                    "ptx_contractible": len(CONTRACTIBLE.findall(ptx)),
                    "sass_fma": sass_fmas(cubin) if capability == sass_capability and squares else None,
                    "seconds": round(seconds, 3),
                }
            )
    with open(out, "w") as f:
        json.dump(records, f, indent=1)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--targets", required=True)
    parser.add_argument("--sass", type=int)
    parser.add_argument("--modes")
    parser.add_argument("--without-compile-options", action="store_true")
    ns = parser.parse_args()
    if ns.without_compile_options:
        triton_stats.COMPILE_OPTIONS.clear()
    wanted = None if ns.modes is None else {int(m) for m in ns.modes.split(",")}
    main(ns.out, [int(c) for c in ns.targets.split(",")], ns.sass, wanted)
