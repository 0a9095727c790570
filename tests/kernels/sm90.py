"""Compile the project's Triton kernels for sm_90 (H100/H200) on a machine without a GPU.

`record()` intercepts Triton launches: a kernel module's `_launch` called with CPU tensors of the
shapes the model uses records (kernel, argument types, constexprs, options) instead of running.
`compile_sm90()` then compiles each record ahead of time for GPUTarget("cuda", 90, 32) with the
ptxas bundled in Triton's wheel: type errors, unsupported ops and shared-memory overflows that the
interpreter cannot see show up here, before a device session.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

SM90 = GPUTarget("cuda", 90, 32)
OPTIONS = ("num_warps", "num_stages", "enable_fp_fusion", "num_ctas")
_TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float8_e4m3fn: "fp8e4nv",
          torch.uint8: "u8", torch.int8: "i8", torch.int16: "i16", torch.int32: "i32", torch.int64: "i64",
          torch.bool: "i1", torch.float8_e8m0fnu: "u8"}


@dataclass
class Launch:
    fn: JITFunction
    signature: dict
    constexprs: dict
    options: dict

    @property
    def key(self) -> tuple:
        return (self.fn.__name__, tuple(sorted(self.signature.items())), repr(sorted(self.constexprs.items())),
                tuple(sorted(self.options.items())))


def _type(v) -> str:
    if isinstance(v, torch.Tensor):
        return "*" + _TYPES[v.dtype]
    if isinstance(v, bool):
        return "i1"
    if isinstance(v, int):
        return "i32" if -2 ** 31 <= v < 2 ** 31 else "i64"
    if isinstance(v, float):
        return "fp32"
    raise TypeError(f"no Triton type for {type(v).__name__}")


@contextlib.contextmanager
def record():
    """Launches made inside the block are recorded (and not run): yields the list they go to."""
    launches: list[Launch] = []
    real = JITFunction.run

    def fake(self, *args, grid, warmup, **kwargs):
        sig, consts = {}, {}
        bound = dict(zip(self.arg_names, args))
        for p in self.params:
            name = p.name
            if name in kwargs:
                v = kwargs[name]
            elif name in bound:
                v = bound[name]
            else:
                v = p.default
            if p.is_constexpr or v is None:
                sig[name], consts[name] = "constexpr", v
            else:
                sig[name] = _type(v)
        launches.append(Launch(self, sig, consts, {k: kwargs[k] for k in OPTIONS if k in kwargs}))

    JITFunction.run = fake
    try:
        yield launches
    finally:
        JITFunction.run = real


def compile_sm90(launch: Launch):
    """The compiled kernel (raises on a compile error)."""
    return triton.compile(ASTSource(launch.fn, launch.signature, launch.constexprs), target=SM90,
                          options=launch.options)
