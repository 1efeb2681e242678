"""``distributed.agreement_group`` without torch.distributed: plain tensors, explicit groups, and
DTensor-like gradients on stand-in meshes (the real meshes are in ``test_distributed.py``)."""

from __future__ import annotations

import itertools
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

from gradscaler import distributed


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


def test_no_gradients_and_plain_gradients_need_no_group() -> None:
    assert distributed.agreement_group([]) is None
    assert distributed.agreement_group([torch.ones(3), torch.zeros(2, 2)]) is None
    assert distributed.agreement_group(torch.ones(2) for _ in range(3)) is None  # any iterable, once


def test_parameters_and_tensor_subclasses_without_a_mesh_need_no_group() -> None:
    assert (
        distributed.agreement_group([torch.nn.Parameter(torch.ones(2)), torch.ones(1).as_subclass(torch.nn.Buffer)])
        is None
    )


def test_explicit_group_wins() -> None:
    explicit = object()
    a, b = FakeMesh("a", (2,)), FakeMesh("b", (2,))
    assert distributed.agreement_group([torch.ones(1)], explicit) is explicit
    assert distributed.agreement_group([dtensor(a, Shard(0))], explicit) is explicit
    # Even gradients that would conflict: the user's group is the answer, nothing is inspected.
    assert distributed.agreement_group([dtensor(a, Shard(0)), dtensor(b, Shard(0))], explicit) is explicit
    assert a.lookups == b.lookups == 0


def test_replicate_only_dtensors_need_no_group() -> None:
    mesh = FakeMesh("m", (2, 2))
    assert distributed.agreement_group([dtensor(mesh, Replicate(), Replicate()), torch.ones(1)]) is None


def test_the_sharded_gradient_names_the_group_whatever_the_order() -> None:
    mesh = FakeMesh("m", (4,))
    grads = [torch.ones(2), dtensor(mesh, Replicate()), dtensor(mesh, Shard(0)), dtensor(mesh, Shard(1))]
    for order in itertools.permutations(grads):
        assert distributed.agreement_group(order) is mesh.groups[0]


def test_the_sharded_mesh_dimension_names_the_group() -> None:
    mesh = FakeMesh("hsdp", (2, 4))
    assert distributed.agreement_group([dtensor(mesh, Replicate(), Shard(0))]) is mesh.groups[1]
    assert distributed.agreement_group([dtensor(mesh, Shard(0), Replicate())]) is mesh.groups[0]


def test_a_mesh_dimension_of_one_rank_shards_nothing() -> None:
    mesh = FakeMesh("m", (1, 2))
    assert distributed.agreement_group([dtensor(mesh, Shard(0), Replicate())]) is None
    assert distributed.agreement_group([dtensor(mesh, Shard(0), Shard(1))]) is mesh.groups[1]


def test_different_groups_are_refused_with_a_message_that_names_them() -> None:
    a, b = FakeMesh("tp", (2,)), FakeMesh("dp", (2, 2))
    grads = [torch.ones(1), dtensor(a, Shard(0)), dtensor(b, Replicate(), Shard(1))]
    with pytest.raises(ValueError, match="process_group=") as info:
        distributed.agreement_group(grads)
    message = str(info.value)
    assert "FakeMesh('tp', (2,))" in message and "FakeMesh('dp', (2, 2))" in message
    assert "Shard(dim=0)" in message and "Shard(dim=1)" in message
    assert "gradient #1" in message and "gradient #2" in message


def test_two_dimensions_of_one_mesh_conflict() -> None:
    mesh = FakeMesh("m", (2, 2))
    with pytest.raises(ValueError, match="different process groups"):
        distributed.agreement_group([dtensor(mesh, Shard(0), Replicate()), dtensor(mesh, Replicate(), Shard(0))])


def test_sharding_over_several_mesh_dimensions_needs_an_explicit_group() -> None:
    mesh = FakeMesh("m", (2, 2))
    with pytest.raises(NotImplementedError, match="explicit process_group"):
        distributed.agreement_group([dtensor(mesh, Shard(0), Shard(1))])
    assert distributed.agreement_group([dtensor(mesh, Shard(0), Shard(1))], "pg") == "pg"


def test_one_lookup_per_mesh_and_placements() -> None:
    mesh = FakeMesh("fsdp", (8,))
    grads = [dtensor(mesh, Shard(0)) for _ in range(100)] + [torch.ones(1)] * 100
    assert distributed.agreement_group(grads) is mesh.groups[0]
    assert mesh.lookups == 1


def test_dtensor_group_of_one_tensor() -> None:
    mesh = FakeMesh("m", (2, 2))
    assert distributed.dtensor_group(torch.ones(1)) is None
    assert distributed.dtensor_group(dtensor(mesh, Replicate(), Shard(0))) is mesh.groups[1]
