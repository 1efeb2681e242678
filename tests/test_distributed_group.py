"""``distributed.resolve`` without torch.distributed: plain tensors, explicit groups, and
DTensor-like parameters on stand-in meshes (the real meshes are in ``test_distributed.py``)."""

from __future__ import annotations

import itertools
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard

from gradscaler import distributed
from gradscaler.scaler import OptState


class FakeMesh:
    """What agreement_group reads of a DeviceMesh: ndim, size(dim), get_group(dim); groups are tokens."""

    def __init__(self, name: str, shape: tuple[int, ...]) -> None:
        self.name, self.shape, self.ndim = name, shape, len(shape)
        self.groups = [object() for _ in shape]
        self.lookups = 0

    def size(self, dim: int) -> int:
        return self.shape[dim]

    def get_group(self, dim: int | None = None) -> Any:
        self.lookups += 1
        if dim is None:
            assert self.ndim == 1, "a multi-dimensional mesh needs a dim"
            dim = 0
        return self.groups[dim]

    def __repr__(self) -> str:
        return f"FakeMesh({self.name!r}, {self.shape})"


def dtensor(mesh: FakeMesh, *placements: Any) -> Any:
    return SimpleNamespace(device_mesh=mesh, placements=placements)


def test_no_parameters_and_plain_parameters_need_no_group() -> None:
    assert distributed.resolve([]) is distributed.LOCAL
    assert distributed.resolve([torch.ones(3), torch.nn.Parameter(torch.zeros(2, 2))]) is distributed.LOCAL


def test_tensor_subclasses_without_a_mesh_need_no_group() -> None:
    assert distributed.resolve([torch.ones(1).as_subclass(torch.nn.Buffer)]) is distributed.LOCAL


def test_explicit_group_wins_and_nothing_is_inspected() -> None:
    explicit = object()
    a, b = FakeMesh("a", (2,)), FakeMesh("b", (2,))
    for params in ([torch.ones(1)], [dtensor(a, Shard(0)), dtensor(b, Shard(0))]):
        agreement = distributed.resolve(params, explicit)
        assert agreement.groups == (explicit,) and agreement.explicit is explicit
        assert agreement.class_labels(params) == [0] * len(params) and agreement.classes == ((0,),)
    assert a.lookups == b.lookups == 0


def test_replicate_only_dtensors_need_no_group() -> None:
    mesh = FakeMesh("m", (2, 2))
    assert distributed.resolve([dtensor(mesh, Replicate(), Replicate()), torch.ones(1)]) is distributed.LOCAL


def test_the_sharded_parameter_names_the_group_whatever_the_order() -> None:
    mesh = FakeMesh("m", (4,))
    params = [torch.ones(2), dtensor(mesh, Replicate()), dtensor(mesh, Shard(0)), dtensor(mesh, Shard(1))]
    for order in itertools.permutations(params):
        agreement = distributed.resolve(order)
        assert agreement.groups == (mesh.groups[0],)
        labels = dict(zip(map(id, order), agreement.class_labels(order), strict=True))
        assert [agreement.classes[labels[id(p)]] for p in params] == [(), (), (0,), (0,)]


def test_the_sharded_mesh_dimension_names_the_group() -> None:
    mesh = FakeMesh("hsdp", (2, 4))
    assert distributed.resolve([dtensor(mesh, Replicate(), Shard(0))]).groups == (mesh.groups[1],)
    assert distributed.resolve([dtensor(mesh, Shard(0), Replicate())]).groups == (mesh.groups[0],)


def test_a_mesh_dimension_of_one_rank_shards_nothing() -> None:
    mesh = FakeMesh("m", (1, 2))
    assert distributed.resolve([dtensor(mesh, Shard(0), Replicate())]) is distributed.LOCAL
    assert distributed.resolve([dtensor(mesh, Shard(0), Shard(1))]).groups == (mesh.groups[1],)


def test_a_parameter_sharded_over_two_mesh_dimensions_reduces_over_both() -> None:
    """FSDP2 + TP: Shard on dp and on tp; a Shard-on-dp-only parameter is reduced over dp alone."""
    mesh = FakeMesh("dp-tp", (2, 2))
    both, dp_only, whole = dtensor(mesh, Shard(0), Shard(1)), dtensor(mesh, Shard(0), Replicate()), torch.ones(1)
    params = [whole, dp_only, both]
    agreement = distributed.resolve(params)
    assert agreement.groups == (mesh.groups[0], mesh.groups[1])
    assert [agreement.classes[label] for label in agreement.class_labels(params)] == [(), (0,), (0, 1)]


def test_a_strided_shard_is_a_shard() -> None:
    """FSDP2 over a tensor-parallel Shard(0) gives _StridedShard on dp, whose is_shard() is False."""
    from torch.distributed.tensor.placement_types import _StridedShard

    mesh = FakeMesh("dp-tp", (2, 2))
    param = dtensor(mesh, _StridedShard(0, split_factor=2), Shard(0))
    agreement = distributed.resolve([param])
    assert agreement.groups == (mesh.groups[0], mesh.groups[1])
    assert agreement.classes[agreement.class_labels([param])[0]] == (0, 1)


def test_groups_of_different_meshes_and_dimensions_are_each_reduced_over() -> None:
    """Each gradient's norm is summed over exactly its own groups; the flag over all of them."""
    tp, dp = FakeMesh("tp", (2,)), FakeMesh("dp", (2, 2))
    params = [torch.ones(1), dtensor(tp, Shard(0)), dtensor(dp, Replicate(), Shard(1)), dtensor(dp, Shard(0), Shard(0))]
    agreement = distributed.resolve(params)
    assert agreement.groups == (tp.groups[0], dp.groups[1], dp.groups[0])
    assert [agreement.classes[label] for label in agreement.class_labels(params)] == [(), (0,), (1,), (1, 2)]


def test_a_partial_parameter_is_refused_with_a_message_that_names_it() -> None:
    mesh = FakeMesh("m", (2,))
    with pytest.raises(ValueError, match="Partial placement") as info:
        distributed.resolve([torch.ones(1), dtensor(mesh, Partial())])
    assert "Parameter #1" in str(info.value) and "FakeMesh('m', (2,))" in str(info.value)
    assert "redistribute" in str(info.value)
    # Over a dimension of one rank a Partial tensor is whole.
    assert distributed.resolve([dtensor(FakeMesh("one", (1,)), Partial())]) is distributed.LOCAL


def test_one_lookup_per_mesh_and_placements() -> None:
    mesh = FakeMesh("fsdp", (8,))
    params = [dtensor(mesh, Shard(0)) for _ in range(100)] + [torch.ones(1)] * 100
    assert distributed.resolve(params).groups == (mesh.groups[0],)
    assert mesh.lookups == 1


def test_without_a_process_group_nothing_is_reduced() -> None:
    """A DTensor needs torch.distributed; without it (this process) the flag and norm stay local."""
    mesh = FakeMesh("m", (2,))
    agreement = distributed.resolve([dtensor(mesh, Shard(0))])
    assert agreement.groups and not agreement.reduces()
    flag = torch.tensor(1.0)
    assert distributed.agree_on_flag_(flag, agreement) is flag and flag.item() == 1.0
    parts = torch.tensor([3.0, 4.0])
    assert distributed.reduce_norms(parts, 2.0, agreement).item() == 5.0


@pytest.mark.parametrize("call", ["unscale_", "step", "clip_grad_norm_", "fused-step", "fused-clip_grad_norm_"])
def test_a_refused_agreement_changes_nothing_and_a_retry_unscales_once(
    monkeypatch: pytest.MonkeyPatch, call: str
) -> None:
    """Issue 20.2a: the agreement is resolved before any gradient is touched, so a refusal leaves the
    gradients bit-identical and the record empty; the retry unscales exactly once."""
    from gradscaler import GradScaler

    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    fused = call.startswith("fused-")
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, fused=fused or None, foreach=None if fused else False)
    scaler = GradScaler("cpu", init_scale=2.0**10)
    scaler.scale(model(torch.randn(4, 3)).sum()).backward()
    before = [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]

    def refuse(params: Any, explicit: Any = None) -> Any:
        raise ValueError("refused")

    monkeypatch.setattr(distributed, "resolve", refuse)
    run = {
        "unscale_": lambda: scaler.unscale_(opt),
        "step": lambda: scaler.step(opt),
        "clip_grad_norm_": lambda: scaler.clip_grad_norm_(opt, 1e9),
    }[call.removeprefix("fused-")]
    with pytest.raises(ValueError, match="refused"):
        run()
    assert all(torch.equal(a, p.grad) for a, p in zip(before, model.parameters(), strict=True))
    monkeypatch.undo()
    run()  # the retry, resolved: exactly one unscale (by the fused kernel inside a fused step)
    factor = 1.0 if call == "fused-clip_grad_norm_" else 2.0**-10  # a fused optimizer's clip hands the scale on
    assert all(torch.equal(a * factor, p.grad) for a, p in zip(before, model.parameters(), strict=True))
    if call.endswith("step"):
        assert scaler._per_optimizer_states[id(opt)]["stage"] is OptState.STEPPED
    else:
        scaler.step(opt)
    scaler.update()
    assert not scaler.last_step_skipped()


def test_the_agreement_is_resolved_once_per_parameter_list(monkeypatch: pytest.MonkeyPatch) -> None:
    """Resolved from the parameters, so kept with them: not per step, again when the param groups change."""
    from gradscaler import GradScaler

    calls: list[int] = []
    resolve = distributed.resolve

    def counting(params: Any, explicit: Any = None) -> distributed.Agreement:
        calls.append(len(params))
        return resolve(params, explicit)

    monkeypatch.setattr(distributed, "resolve", counting)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD([model.weight], lr=0.1)
    scaler = GradScaler("cpu")
    for step in range(4):
        if step == 2:
            opt.add_param_group({"params": [model.bias]})
        opt.zero_grad()
        scaler.scale(model(torch.ones(1, 3)).sum()).backward()
        if step % 2:
            scaler.clip_grad_norm_(opt, 1.0)
        else:
            scaler.unscale_(opt)
        scaler.step(opt)
        scaler.update()
    assert calls == [1, 2]
