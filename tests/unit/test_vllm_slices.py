"""`derive_boxes` (rollout_engines/vllm/slices.py) without vLLM: a model whose loaders are plain functions of
the kinds vLLM's are (a column-parallel narrow, a row-parallel one, a replicated copy) and of kinds the trace
must refuse (a strided read, a loader that changes values); the model is unchanged by the trace; a boxed
tensor through `ModelLoadSink` loads what the whole tensor loads. vLLM's own loaders: test_vllm_slices_real.py."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

from lightning_weightsync.protocol.boxes import Box
from lightning_weightsync.protocol.chunks import TensorMeta
from lightning_weightsync.rollout_engines.vllm.slices import derive_boxes
from lightning_weightsync.rollout_engines.worker import ModelLoadSink

RANK, WORLD = 1, 2


def param(shape: tuple[int, ...], loader: Callable[..., Any] | None) -> torch.nn.Parameter:
    p = torch.nn.Parameter(torch.zeros(shape), requires_grad=False)
    if loader is not None:
        p.weight_loader = loader  # type: ignore[attr-defined]
    return p


def column(p: torch.Tensor, w: torch.Tensor) -> None:
    size = p.shape[0]
    p.data.copy_(w.narrow(0, RANK * size, size))


def row(p: torch.Tensor, w: torch.Tensor) -> None:
    size = p.shape[1]
    p.data.copy_(w.narrow(1, RANK * size, size))


def strided(p: torch.Tensor, w: torch.Tensor) -> None:
    p.data.copy_(w[RANK::WORLD])


def scaled(p: torch.Tensor, w: torch.Tensor) -> None:
    p.data.copy_(w.narrow(0, 0, p.shape[0]) * 0.5)


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.col = param((4, 6), column)
        self.row = param((6, 3), row)
        self.norm = param((6,), None)  # no loader: the default copy, whole
        self.odd = param((4, 6), strided)
        self.scale = param((4, 6), scaled)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters())
        for name, w in weights:
            if name == "skipped":
                continue
            p = params[name]
            getattr(p, "weight_loader", lambda p, w: p.data.copy_(w))(p, w)


SHAPES = {"col": (8, 6), "row": (6, 6), "norm": (6,), "odd": (8, 6), "scale": (8, 6), "skipped": (5, 5)}


def test_boxes_of_column_row_and_replicated_loaders_and_refusals_with_reasons() -> None:
    model = Model()
    before = {n: t.clone() for n, t in model.state_dict().items()}
    slices = derive_boxes(model, SHAPES)
    assert slices.boxes == {
        "col": Box((4, 0), (4, 6)),
        "row": Box((0, 3), (6, 3)),
        "skipped": Box((0, 0), (1, 1)),  # read by no parameter: one element
    }
    assert slices.unread == ["skipped"]
    assert slices.whole["norm"] == "read whole"
    assert "not a box" in slices.whole["odd"]
    assert "did not copy" in slices.whole["scale"]
    assert all(torch.equal(model.state_dict()[n], t) for n, t in before.items())  # the trace wrote nothing
    assert all(type(p) is torch.nn.Parameter for p in model.parameters())  # the real parameters are back
    assert slices.nbytes(SHAPES, lambda _: 4) == 4 * (4 * 6 + 6 * 3 + 6 + 8 * 6 + 8 * 6 + 1)


def test_a_boxed_tensor_through_the_sink_loads_what_the_whole_tensor_loads() -> None:
    torch.manual_seed(0)
    state = {n: torch.randn(s) for n, s in SHAPES.items()}
    slices = derive_boxes(Model(), SHAPES)
    whole, sliced = Model(), Model()
    whole.load_weights(state.items())
    sink = ModelLoadSink(sliced, expected=3)
    sink.begin(3)
    for name, tensor in state.items():
        box = slices.boxes.get(name)
        assert sink.destination(TensorMeta(name, tuple(tensor.shape), tensor.dtype, 0, 0, box=box)) is None
        sink.accept(name, box.of(tensor).contiguous() if box is not None else tensor)
    assert sink.shapes["col"] == ((8, 6), torch.float32)
    for name, tensor in whole.state_dict().items():
        assert torch.equal(sliced.state_dict()[name], tensor), name
