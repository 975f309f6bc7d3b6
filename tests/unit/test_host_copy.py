"""`HostCopy`: the rollback copy of an engine worker's model (vllm.rollback=host). Taken before a version, put
back after one that failed: bitwise, into the model's own storage (CUDA graphs keep pointing at it), tied
tensors once; what cannot be restored is named, never silently skipped. The GPU case (pinned memory,
non-blocking copies) runs in the device kit (`-m gpu`)."""

from __future__ import annotations

import pytest
import torch

from lightning_weightsync.rollout_engines.host_copy import HostCopy


def _model(device: str = "cpu") -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Embedding(50, 16), torch.nn.Linear(16, 50, bias=False), torch.nn.LayerNorm(50))
    model[1].weight = model[0].weight  # tied, as embeddings often are
    model.register_buffer("scale", torch.tensor([0.5, 2.0]))
    return model.to(device)


def _roundtrip(device: str) -> None:
    model = _model(device)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    storage = {k: v.data_ptr() for k, v in model.state_dict().items()}
    copy = HostCopy(model)
    assert len(copy.copies) == 4  # the tied weight once: embedding, layer norm weight and bias, the buffer
    assert all(t.device.type == "cpu" for t in copy.copies.values())
    copy.take(model)
    with torch.no_grad():  # a version that broke half-way: some tensors new, one buffer too
        model[0].weight.add_(1.0)
        model.scale.mul_(3)
    assert copy.restore(model) == []
    after = model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())
    assert {k: v.data_ptr() for k, v in after.items()} == storage  # restored in place, not re-bound


def test_restore_puts_the_model_back_bitwise_in_its_own_storage() -> None:
    _roundtrip("cpu")


def test_what_cannot_be_restored_is_named() -> None:
    model = _model()
    copy = HostCopy(model)
    assert copy.restore(model) == ["(no copy was taken before this version)"]
    copy.take(model)
    model[2].bias = torch.nn.Parameter(torch.zeros(7))  # a layer re-created with another shape
    assert copy.restore(model) == ["2.bias"]


def test_a_tensor_whose_dtype_changed_is_named_not_restored_with_a_cast() -> None:
    """Same shape, another dtype (a layer re-created in bf16): the fp32 copy cannot be put back bitwise; a copy_
    would cast it silently. It is reported lost and left as it is; the others are restored."""
    model = _model()
    copy = HostCopy(model)
    copy.take(model)
    before = model[2].weight.detach().clone()
    with torch.no_grad():
        model[2].weight.add_(1.0)
    model[2].bias = torch.nn.Parameter(torch.full((50,), 3.0, dtype=torch.bfloat16))
    assert copy.restore(model) == ["2.bias"]
    assert model[2].bias.dtype == torch.bfloat16 and torch.equal(model[2].bias, torch.full((50,), 3.0).bfloat16())
    assert torch.equal(model[2].weight, before)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: pinned host memory and async copies")
def test_restore_on_a_gpu_with_pinned_memory() -> None:
    _roundtrip("cuda")
    assert all(t.is_pinned() for t in HostCopy(_model("cuda")).copies.values())


def test_a_refused_copy_is_never_restored_from_an_older_version() -> None:
    """A copy refused because the model's tensors changed must not leave the previous version's copy in
    place: `restore` would then put back an older version and report it as the one before the failure."""
    model = _model()
    copy = HostCopy(model)
    copy.take(model)  # before version 1: accepted
    with torch.no_grad():
        model[0].weight.add_(1.0)  # version 1 lands
    model.register_buffer("transient", torch.zeros(2))  # the tensor set changes: the copy for version 2 is refused
    copy.take(model)
    del model.transient  # ... and changes back while version 2 runs (e.g. a layer rebuilt by the reload)
    assert copy.restore(model) == ["(no copy was taken before this version)"], "an older version's copy restored"
