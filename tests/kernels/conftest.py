"""Kernel tests: the Triton kernels against their torch references.

Without a CUDA device the kernels run under Triton's interpreter on CPU; with one, the same tests
run compiled on CUDA. Helpers build a paged pool whose blocks are a random permutation and whose
unused slots (free blocks, the tail of each partial last block) hold NaN, so a kernel that reads
past a sequence's length, or through a padding entry of the block table, produces NaN.
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest
import torch

if not torch.cuda.is_available():
    # Must be set before any kernel is launched (the kernels are jitted lazily, at first launch).
    os.environ.setdefault("TRITON_INTERPRET", "1")

DEVICES = ["cuda"] if torch.cuda.is_available() else ["cpu"]

# Bounds on |triton - reference| (used as both atol and rtol). The reference runs in fp32 on the
# same (already rounded) inputs, so the bound covers the kernel's own rounding: fp16/bf16 output
# and the probabilities rounded to the input dtype before the P @ V product.
TOLERANCES = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 2e-2}


@pytest.fixture(params=DEVICES)
def device(request: pytest.FixtureRequest) -> torch.device:
    return torch.device(request.param)


@pytest.fixture
def generator(request: pytest.FixtureRequest) -> torch.Generator:
    """Random inputs that differ per test case yet replay the same on a rerun."""
    return torch.Generator().manual_seed(zlib.crc32(request.node.nodeid.encode()))


@dataclass(frozen=True)
class PagedKV:
    kv_cache: torch.Tensor  # the pool the kernel reads: unused slots are NaN
    clean_kv_cache: torch.Tensor  # the same pool with finite values everywhere, for the reference
    block_tables: torch.Tensor  # [num_seqs, max_blocks + 2] int32; surplus entries are padding


def make_paged_kv(
    seq_lens: list[int], block_size: int, num_kv_heads: int, head_dim: int,
    dtype: torch.dtype, device: torch.device, generator: torch.Generator,
) -> PagedKV:
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    table_width = max(blocks_per_seq) + 2
    num_blocks = sum(blocks_per_seq) + 3
    shape = (num_blocks, 2, block_size, num_kv_heads, head_dim)
    clean = torch.randn(shape, generator=generator).to(dtype=dtype, device=device)
    poisoned = torch.full_like(clean, float("nan"))
    order = torch.randperm(num_blocks, generator=generator).tolist()
    spare = order[sum(blocks_per_seq):]  # never holds a sequence's tokens: stays NaN
    table = torch.empty(len(seq_lens), table_width, dtype=torch.int32)
    used = 0
    for i, (seq_len, num_used) in enumerate(zip(seq_lens, blocks_per_seq, strict=True)):
        own = order[used:used + num_used]
        used += num_used
        # Padding entries point at NaN blocks: a kernel must never read through them.
        padding = [spare[j % len(spare)] for j in range(table_width - num_used)]
        table[i] = torch.tensor(own + padding)
        for j, block in enumerate(own):
            valid = min(block_size, seq_len - j * block_size)
            poisoned[block, :, :valid] = clean[block, :, :valid]
    return PagedKV(poisoned, clean, table.to(device))


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert not actual.isnan().any(), "kernel output holds NaN: an element was unwritten or " \
        "a NaN (unused) pool slot was read"
    tol = TOLERANCES[dtype]
    torch.testing.assert_close(actual.float(), expected.float(), atol=tol, rtol=tol)


@pytest.fixture
def paged_kv() -> Callable[..., PagedKV]:
    return make_paged_kv


@pytest.fixture
def close() -> Callable[[torch.Tensor, torch.Tensor, torch.dtype], None]:
    return assert_close


def _make_pool(gen: torch.Generator, num_blocks: int, block_size: int, num_kv_heads: int,
               head_dim: int, layout: str) -> torch.Tensor:
    """``[num_blocks, 2, B, Hkv, D]``, ``interleaved`` (contiguous) or stored as ``planes`` (all
    keys, then all values: the runner's pool, which the CPU paths read in place)."""
    if layout == "interleaved":
        return torch.randn(num_blocks, 2, block_size, num_kv_heads, head_dim, generator=gen)
    planes = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    return planes.transpose(0, 1)


@pytest.fixture
def make_pool() -> Callable[..., torch.Tensor]:
    """Random pools for the CPU paths (no NaN: they may read a partial block's unused slots)."""
    return _make_pool


@pytest.fixture(params=["avx512_vnni", "avx2", "scalar", "torch"])
def isa(request: pytest.FixtureRequest) -> Iterator[str]:
    """Each path of ``agentd.kernels.cpu`` this CPU runs (the others skip), set for the test."""
    from agentd.kernels import cpu

    if request.param not in cpu.available_isas():
        pytest.skip(cpu.native_unavailable_reason()
                    or f"this CPU lacks {request.param} (cpuid): its kernels only compile here")
    cpu.set_isa(request.param)
    yield request.param
    cpu.set_isa(None)
