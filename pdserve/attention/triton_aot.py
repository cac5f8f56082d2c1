"""The Triton kernels compiled for a GPU architecture without a GPU: Triton's own toolchain (its bundled ptxas)
turns the kernels into a cubin for, say, sm_90 on any machine, which the interpreter (TRITON_INTERPRET=1) never
does. That catches what only a GPU compile rejects (seen: a `tl.dot` whose K is under 16, a `break` in a loop;
the interpreter runs both) and reports what decides occupancy: registers, shared memory, spills.

`compile_launches` replaces the kernels' launches inside `paged_decode` for the duration of a `with` block: each
launch is specialized through Triton's own argument binder, exactly as the JIT would specialize it on a GPU
(dtypes, 16-byte alignment, integers equal to 1 or divisible by 16), compiled for the target, and recorded; no
kernel runs, so the output is left unwritten. Written against triton 3.6 (the test extra's pin): the binder is
not public API. It needs a process where TRITON_INTERPRET was unset when triton was imported: with it set,
triton.language's own @jit helpers (tl.cdiv, tl.max) are interpreted functions, which a compile cannot call.
"""
from __future__ import annotations

import contextlib
import re
import subprocess
import tempfile
from dataclasses import dataclass

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import JITFunction, create_function_from_signature

from pdserve.attention import triton_decode

KERNELS = ("_decode_split", "_combine")
# Hopper's per-SM limits (sm_90: H100, H200), for the occupancy estimate
SM90 = dict(regs=65536, shared=233472, threads=2048, ctas=32, shared_per_cta=232448)


@dataclass(frozen=True)
class CompiledLaunch:
    kernel: str
    constexprs: dict
    grid: tuple
    num_warps: int
    registers: int
    shared_bytes: int
    local_bytes: int  # spills land in local memory: 0 means none
    key: str  # the compiled variant: launches with equal keys share one compile

    def ctas_per_sm(self, limits: dict = SM90) -> int:
        """Resident blocks per SM from registers, shared memory and threads, rounded as the CUDA occupancy
        calculator rounds them (registers in 256 per warp; 1 KB of shared memory per block kept by the system)."""
        threads = 32 * self.num_warps
        regs_per_warp = -(-self.registers * 32 // 256) * 256
        by_regs = limits["regs"] // (regs_per_warp * self.num_warps)
        by_shared = limits["shared"] // (self.shared_bytes + 1024)
        return min(by_regs, by_shared, limits["threads"] // threads, limits["ctas"])


def resource_usage(cubin: bytes) -> tuple[int, int]:
    """(registers, local bytes) per thread, from cuobjdump's resource report of the cubin."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        report = subprocess.run([triton.knobs.nvidia.cuobjdump.path, "-res-usage", f.name], capture_output=True,
                                text=True, check=True).stdout
    regs, local = re.search(r"REG:(\d+).*LOCAL:(\d+)", report).groups()
    return int(regs), int(local)


class _Compiler:
    def __init__(self, name: str, target: GPUTarget, records: list[CompiledLaunch]):
        # TRITON_INTERPRET=1 set after triton's import and before the kernels': rebuild the JIT one, same decorator
        kernel = getattr(triton_decode, name)
        self.fn = kernel if isinstance(kernel, JITFunction) else JITFunction(kernel.fn, **kernel.kwargs)
        self.name, self.target, self.records = name, target, records
        self.backend = make_backend(target)
        self.binder = create_function_from_signature(self.fn.signature, self.fn.params, self.backend)

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            fn, backend = self.fn, self.backend
            bound, specialization, options = self.binder(*args, **kwargs)
            options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, options)
            compiled = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=self.target,
                                      options=options.__dict__)
            regs, local = resource_usage(compiled.asm["cubin"])
            names = {(i,): p.name for i, p in enumerate(fn.params)}
            self.records.append(CompiledLaunch(
                self.name, {names[k]: v for k, v in constexprs.items()}, tuple(grid), compiled.metadata.num_warps,
                regs, compiled.metadata.shared, local, compiled.metadata.hash))
        return launch


@contextlib.contextmanager
def compile_launches(target: GPUTarget = GPUTarget("cuda", 90, 32)):
    """Within the block, `paged_decode` compiles its kernels for `target` instead of running them; yields the
    list of CompiledLaunch records, one per launch."""
    if not isinstance(triton.language.cdiv, JITFunction):
        raise RuntimeError("triton was imported under TRITON_INTERPRET=1, so triton.language's helpers are "
                           "interpreted and cannot be compiled; compile in a process without it")
    records: list[CompiledLaunch] = []
    saved = {name: getattr(triton_decode, name) for name in KERNELS}
    try:
        for name in KERNELS:
            setattr(triton_decode, name, _Compiler(name, target, records))
        yield records
    finally:
        for name, fn in saved.items():
            setattr(triton_decode, name, fn)


def compile_decode(dtype, qlen: int, group: int, head_dim: int, block_size: int, kv_heads: int = 2, rows: int = 4,
                   width: int = 6, splits: int = 2, target: GPUTarget = GPUTarget("cuda", 90, 32),
                   tile: int = 0, num_warps: int = 4, num_stages: int = 3) -> list[CompiledLaunch]:
    """Compile the launches one `paged_decode` call makes for this shape (placeholder CPU tensors of the engine's
    dtypes and layouts; their contents are never read)."""
    q = torch.zeros(rows * qlen, kv_heads * group, head_dim, dtype=dtype)
    cache = torch.zeros(2, rows * width + 1, block_size, kv_heads, head_dim, dtype=dtype)
    table = torch.zeros(rows, width, dtype=torch.long)
    positions = torch.zeros(rows, qlen, dtype=torch.long)
    with compile_launches(target) as records:
        triton_decode.paged_decode(q, cache, table, positions, head_dim ** -0.5, splits,
                                   triton_decode.DecodeWorkspace(torch.device("cpu")), tile, num_warps, num_stages)
    return records


if __name__ == "__main__":  # python -m pdserve.attention.triton_aot: the device scripts' shape, K = 0 and 3
    for q in (1, 4):
        for r in compile_decode(torch.bfloat16, q, 2, 128, 16, kv_heads=8):
            print(f"Qwen3-0.6B bf16 q={q} {r.kernel}: {r.registers} registers, {r.shared_bytes} B shared, "
                  f"{r.local_bytes} B local, ~{r.ctas_per_sm()} blocks per SM (sm_90, estimate)")
