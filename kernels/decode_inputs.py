"""A captured decode step's inputs, set in one launch before its replay.

A replay copies the step's rows into the graph's static input buffers (token ids,
positions, cache slots, context lengths, page table) and pads the rows past the batch. As
torch ops that is five device copies plus five fills when the batch is smaller than the
graph, each a ~1.5 µs launch ahead of the step's first kernel (H100 trace of a B=64 step).
Here one program per graph row copies or pads all five.

Shape legend: B the graph's rows, n the step's rows (n ≤ B), P the step's page-table width
(≤ the graph's).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from kernels.host_math import next_power_of_2
from kernels.launch import fast
from kernels.pdl import grid_dependency_control

# Page-table columns a program copies at once.
PAGE_BLOCK = 128


@dataclass(frozen=True)
class DecodeInputs:
    """input_ids, positions, slot_mapping: int64 [rows]; context_lens: int32 [rows];
    page_table: int32 [rows, pages] (unit column stride)."""

    input_ids: Tensor
    positions: Tensor
    slot_mapping: Tensor
    context_lens: Tensor
    page_table: Tensor

    @property
    def rows(self) -> int:
        return self.input_ids.shape[0]


def set_decode_inputs_ref(
    dst: DecodeInputs, src: DecodeInputs, pad_page: int, page_size: int
) -> None:
    """Semantics: rows [0, n) of dst take src's (the page table its first P columns); rows
    [n, B) are padding: token 0 at position 0 with one cached token in slot
    pad_page · page_size, page_table[:, :P] = pad_page. Page-table columns past P keep what
    they held (no kernel reads a page entry past its row's context)."""
    _check(dst, src)
    n, pages = src.rows, src.page_table.shape[1]
    for out, rows, pad in (
        (dst.input_ids, src.input_ids, 0),
        (dst.positions, src.positions, 0),
        (dst.slot_mapping, src.slot_mapping, pad_page * page_size),
        (dst.context_lens, src.context_lens, 1),
    ):
        out[:n] = rows
        out[n:] = pad
    dst.page_table[:n, :pages] = src.page_table
    dst.page_table[n:, :pages] = pad_page


@triton.jit(do_not_specialize=["n", "pages", "pad_page", "page_size"])
def _set_decode_inputs_kernel(
    ids_src, ids_dst, pos_src, pos_dst, slot_src, slot_dst, ctx_src, ctx_dst,
    table_src, table_dst, n, pages, stride_src, stride_dst, pad_page, page_size,
    BLOCK_P: tl.constexpr,
):  # fmt: skip
    grid_dependency_control()
    row = tl.program_id(0)
    live = row < n
    src_row = tl.minimum(row, tl.maximum(n - 1, 0))
    # Padding rows load nothing (masked) and store the padding values.
    pad_slot = pad_page * page_size
    tl.store(ids_dst + row, tl.load(ids_src + src_row, mask=live, other=0))
    tl.store(pos_dst + row, tl.load(pos_src + src_row, mask=live, other=0))
    tl.store(slot_dst + row, tl.load(slot_src + src_row, mask=live, other=pad_slot))
    tl.store(ctx_dst + row, tl.load(ctx_src + src_row, mask=live, other=1))
    for p in range(0, pages, BLOCK_P):
        offs = p + tl.arange(0, BLOCK_P)
        mask = offs < pages
        entries = tl.load(
            table_src + src_row.to(tl.int64) * stride_src + offs, mask=mask & live, other=pad_page
        )
        tl.store(table_dst + row.to(tl.int64) * stride_dst + offs, entries, mask=mask)


def set_decode_inputs(dst: DecodeInputs, src: DecodeInputs, pad_page: int, page_size: int) -> None:
    """`set_decode_inputs_ref` in one launch (one program per row of dst)."""
    _check(dst, src)
    pages = src.page_table.shape[1]
    fast(_set_decode_inputs_kernel)[(dst.rows,)](
        src.input_ids, dst.input_ids, src.positions, dst.positions, src.slot_mapping,
        dst.slot_mapping, src.context_lens, dst.context_lens, src.page_table, dst.page_table,
        src.rows, pages, src.page_table.stride(0), dst.page_table.stride(0), pad_page, page_size,
        BLOCK_P=min(PAGE_BLOCK, next_power_of_2(max(pages, 16))),
    )  # fmt: skip


def pad_decode_inputs(dst: DecodeInputs, pad_page: int, page_size: int) -> None:
    """Every row of dst as padding, across its whole page table: `set_decode_inputs` from
    a step of no rows (a graph's inputs before their first replay)."""
    empty = DecodeInputs(*(t[:0] for t in vars(dst).values()))
    set_decode_inputs(dst, empty, pad_page, page_size)


def _check(dst: DecodeInputs, src: DecodeInputs) -> None:
    """Rows, widths, dtypes and strides the kernel relies on (messages name the mismatch)."""
    if src.rows > dst.rows or src.page_table.shape[1] > dst.page_table.shape[1]:
        raise ValueError(
            f"step of {src.rows} rows × {src.page_table.shape[1]} pages does not fit the "
            f"graph's {dst.rows} × {dst.page_table.shape[1]}"
        )
    for name in ("input_ids", "positions", "slot_mapping", "context_lens", "page_table"):
        a, b = getattr(src, name), getattr(dst, name)
        want = torch.int32 if name in ("context_lens", "page_table") else torch.int64
        if a.dtype != want or b.dtype != want or a.shape[0] != src.rows or b.shape[0] != dst.rows:
            raise ValueError(
                f"{name}: step {tuple(a.shape)} {a.dtype} / graph {tuple(b.shape)} {b.dtype}; "
                f"want {want} with {src.rows} / {dst.rows} rows"
            )
        if a.stride(-1) != 1 or b.stride(-1) != 1:
            raise ValueError(f"{name} needs a unit stride along its last dim")
