"""Compile the project's Triton kernels for sm_90 (H100/H200) on a machine without a GPU.

`record()` intercepts Triton launches: a kernel module's `_launch` called with CPU tensors of the
shapes the model uses records (kernel, argument types, constexprs, options) instead of running.
`compile_sm90()` then compiles each record ahead of time for GPUTarget("cuda", 90, 32) with the
ptxas bundled in Triton's wheel: type errors, unsupported ops and shared-memory overflows that the
interpreter cannot see show up here, before a device session.

By default a record compiles generically (no argument specialisation). `compile_sm90(launch,
specialize=True)` compiles what the JIT would build on a GPU for the same argument values: pointers
16-byte aligned and integers divisible by 16 carry tt.divisibility, integers equal to 1 become
constexprs. Only that build vectorises the loads and pipelines them through shared memory (cp.async /
TMA with num_stages buffers), so its registers, spills and shared memory are the device's.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import triton
from triton._C.libtriton import native_specialize_impl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.compiler.compiler import make_backend
from triton.runtime.jit import JITFunction
from triton.tools.tensor_descriptor import TensorDescriptor

try:  # Gluon kernels (kernels/grouped_gemm_fp8_gluon.py) compile from their own AST source
    from triton.experimental.gluon._runtime import GluonASTSource, GluonJITFunction
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonTensorDescriptor
except ImportError:
    GluonASTSource = GluonJITFunction = GluonTensorDescriptor = None

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
    specialized: tuple = ()  # (signature, constexprs, attrs) as the JIT specialises these values on a GPU

    @property
    def key(self) -> tuple:
        return (self.fn.__name__, tuple(sorted(self.signature.items())), repr(sorted(self.constexprs.items())),
                tuple(sorted(self.options.items())))


def _type(v) -> str:
    if isinstance(v, TensorDescriptor) or (GluonTensorDescriptor is not None and isinstance(v, GluonTensorDescriptor)):
        # host-side TMA descriptor: its type names dtype and block shape (and, for Gluon, its shared layout)
        return native_specialize_impl(type(make_backend(SM90)), v, False, False, False)[0]
    if isinstance(v, torch.Tensor):
        return "*" + _TYPES[v.dtype]
    if isinstance(v, bool):
        return "i1"
    if isinstance(v, int):
        return "i32" if -2 ** 31 <= v < 2 ** 31 else "i64"
    if isinstance(v, float):
        return "fp32"
    raise TypeError(f"no Triton type for {type(v).__name__}")


def _specialize(fn: JITFunction, sig: dict, consts: dict, bound: dict, kwargs: dict) -> tuple:
    """The JIT's specialisation of the recorded values (CPU tensors stand for device ones: their data
    pointers are at least 16-byte aligned, as the CUDA caching allocator's are)."""
    backend = make_backend(SM90)
    sig, consts, attrs = dict(sig), dict(consts), {}
    for i, p in enumerate(fn.params):
        if sig[p.name] == "constexpr":
            continue
        v = kwargs[p.name] if p.name in kwargs else bound.get(p.name, p.default)
        ty, attr = native_specialize_impl(type(backend), v, False, not p.do_not_specialize,
                                          not p.do_not_specialize_on_alignment)
        if ty == "constexpr":       # an integer equal to 1
            sig[p.name], consts[p.name] = "constexpr", attr
        elif isinstance(attr, str) and attr:
            attrs[(i,)] = backend.parse_attr(attr)
    return sig, consts, attrs


def launch_of(fn: JITFunction, bound: dict, kwargs: dict) -> Launch:
    """The Launch of `fn` called with positional values `bound` ({name: value}) and keyword values `kwargs`
    (parameters and launch options such as num_warps), as `record` keeps it."""
    sig, consts = {}, {}
    for p in fn.params:
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
    return Launch(fn, sig, consts, {k: kwargs[k] for k in OPTIONS if k in kwargs},
                  _specialize(fn, sig, consts, bound, kwargs))


@contextlib.contextmanager
def record():
    """Launches made inside the block are recorded (and not run): yields the list they go to."""
    launches: list[Launch] = []
    real = JITFunction.run

    def fake(self, *args, grid, warmup, **kwargs):
        launches.append(launch_of(self, dict(zip(self.arg_names, args)), kwargs))

    JITFunction.run = fake
    try:
        yield launches
    finally:
        JITFunction.run = real


def compile_sm90(launch: Launch, specialize: bool = False):
    """The compiled kernel (raises on a compile error); specialize: as the JIT would build it on a GPU."""
    source = ASTSource
    if GluonJITFunction is not None and isinstance(launch.fn, GluonJITFunction):
        source = GluonASTSource
    if specialize:
        sig, consts, attrs = launch.specialized
        return triton.compile(source(launch.fn, sig, consts, attrs), target=SM90, options=launch.options)
    return triton.compile(source(launch.fn, launch.signature, launch.constexprs), target=SM90,
                          options=launch.options)
