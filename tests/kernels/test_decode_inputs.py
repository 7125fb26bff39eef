"""The one-launch setting of a captured decode step's inputs against its torch form."""

from __future__ import annotations

import pytest
import torch

from kernels.decode_inputs import (
    DecodeInputs,
    pad_decode_inputs,
    set_decode_inputs,
    set_decode_inputs_ref,
)
from tests.fixtures.triton_interpret import kernel_device

DEVICE = kernel_device()
GPU = [pytest.mark.gpu, pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA GPU")]
PAD_PAGE, PAGE_SIZE = 7, 16


def _inputs(rows: int, pages: int, g: torch.Generator, device: str) -> DecodeInputs:
    """Random rows: tokens, positions, slots and page entries all distinct from padding."""

    def ints(*shape: int, dtype: torch.dtype) -> torch.Tensor:
        return torch.randint(100, 10_000, shape, generator=g, dtype=dtype).to(device)

    return DecodeInputs(
        ints(rows, dtype=torch.int64),
        ints(rows, dtype=torch.int64),
        ints(rows, dtype=torch.int64),
        ints(rows, dtype=torch.int32),
        ints(rows, pages, dtype=torch.int32),
    )


def _clone(inputs: DecodeInputs) -> DecodeInputs:
    return DecodeInputs(*(t.clone() for t in vars(inputs).values()))


@pytest.mark.parametrize(
    "on_gpu", [False, pytest.param(True, marks=GPU)], ids=["interpreter", "gpu"]
)
@pytest.mark.parametrize(
    "graph_rows,step_rows,graph_pages,step_pages",
    [(8, 8, 4, 4), (8, 3, 4, 2), (64, 1, 300, 130), (16, 16, 200, 129), (4, 0, 4, 1)],
)
def test_set_decode_inputs_equals_ref(on_gpu, graph_rows, step_rows, graph_pages, step_pages):
    """The step's rows copied, rows past them padded, page-table columns past the step's
    left as they were (stale values in the graph's buffers to begin with)."""
    if on_gpu and DEVICE != "cuda":
        pytest.skip("needs a CUDA GPU")
    g = torch.Generator().manual_seed(graph_rows * 1000 + step_rows)
    graph = _inputs(graph_rows, graph_pages, g, DEVICE)
    step = _inputs(step_rows, step_pages, g, DEVICE)
    ref = _clone(graph)
    set_decode_inputs_ref(ref, step, PAD_PAGE, PAGE_SIZE)
    set_decode_inputs(graph, step, PAD_PAGE, PAGE_SIZE)
    for name, want in vars(ref).items():
        assert torch.equal(getattr(graph, name), want), name
    assert torch.equal(ref.slot_mapping[step_rows:].cpu(), torch.full(
        (graph_rows - step_rows,), PAD_PAGE * PAGE_SIZE))  # fmt: skip
    assert (ref.page_table[:, step_pages:] != PAD_PAGE).all()  # untouched columns


def test_pad_decode_inputs_pads_every_row_and_page_column():
    """A graph's inputs before their first replay: all padding, the whole page table."""
    graph = _inputs(6, 40, torch.Generator().manual_seed(1), DEVICE)
    pad_decode_inputs(graph, PAD_PAGE, PAGE_SIZE)
    assert (graph.input_ids == 0).all() and (graph.positions == 0).all()
    assert (graph.slot_mapping == PAD_PAGE * PAGE_SIZE).all() and (graph.context_lens == 1).all()
    assert (graph.page_table == PAD_PAGE).all()


def test_set_decode_inputs_refuses_a_step_wider_than_the_graph():
    g = torch.Generator().manual_seed(0)
    graph = _inputs(4, 3, g, DEVICE)
    for step in (_inputs(5, 3, g, DEVICE), _inputs(4, 4, g, DEVICE)):
        with pytest.raises(ValueError, match="does not fit"):
            set_decode_inputs(graph, step, PAD_PAGE, PAGE_SIZE)
    wrong = _inputs(2, 3, g, DEVICE)
    wrong = DecodeInputs(wrong.input_ids, wrong.positions, wrong.slot_mapping,
                         wrong.context_lens.long(), wrong.page_table)  # fmt: skip
    with pytest.raises(ValueError, match="context_lens"):
        set_decode_inputs(graph, wrong, PAD_PAGE, PAGE_SIZE)
