"""``gradscaler bench --sections host`` (tools/bench_host.py): the kernel launches a step issues on the
CUDA route, ours against torch's scaler, held exactly per loop shape (times stay in the bench).

Counted on the CPU with a dispatch mode, one steady step (after the telemetry's first copy landed):
``generic`` is the route CUDA takes without Triton; ``triton`` runs gradscaler's read passes through
its Triton kernels (here in Triton's interpreter), the route of CUDA builds. A count that moves,
either way, fails here: a new op on the step's path is a decision, made by editing this table;
docs/architecture.md gives the floor. The ``+ logger`` rows are ours with a logger attached against
torch's scaler, which logs nothing: their launches are what logging costs (each step's record copied at
once, a read of every gradient for attribution), held here too, and the target (never above torch, on
either route) is for the rows without one.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from typing import Any

import pytest
import torch

from gradscaler.tools import bench_host, host_counts
from helpers import load_benchmark

# shape -> (torch's launches, ours, ours' Triton launches): one steady step, outside forward and backward
GENERIC = {
    "mlp adamw": (18, 14, 0),
    "mlp adamw + unscale_ + clip": (26, 22, 0),
    "mlp fused + scaler clip": (21, 18, 0),
    "mlp adamw + masters": (20, 16, 0),
    "gpt adamw": (18, 14, 0),
    "gpt adamw + scaler clip": (26, 25, 0),
    "gpt fused": (12, 10, 0),
    "gpt fused + scaler clip": (21, 18, 0),
    "gpt sgd": (12, 8, 0),
    "gpt sgd + scaler clip": (20, 19, 0),
    "gpt adamw + masters": (20, 16, 0),
    "gpt adamw + scaler clip + masters": (28, 27, 0),
    "gpt fused + masters": (14, 10, 0),
    "gpt fused + scaler clip + masters": (23, 20, 0),
    "mlp adamw + logger": (18, 17, 0),
    "gpt adamw + logger": (18, 17, 0),
}
TRITON = {  # the MLP shapes: at 147 tensors the interpreter takes half a minute a step
    "mlp adamw": (18, 14, 0),
    "mlp adamw + unscale_ + clip": (26, 22, 0),
    "mlp fused + scaler clip": (21, 13, 2),
    "mlp adamw + masters": (20, 14, 1),
    "mlp adamw + logger": (18, 16, 2),
}
SHAPES = {shape.name: shape for shape in bench_host.SHAPES}


def test_the_tables_name_every_shape() -> None:
    assert set(GENERIC) == set(SHAPES)
    assert set(TRITON) == {name for name, shape in SHAPES.items() if shape.model == "mlp"}


@pytest.mark.parametrize(("route", "name"), [("generic", n) for n in GENERIC] + [("triton", n) for n in TRITON])
def test_launches_per_step(route: str, name: str) -> None:
    row = bench_host.measure(SHAPES[name], steps=1, warmup=bench_host.RECORDS_PER_COPY + 2, route=route)
    torch_total, ours_total = row["torch"]["total"], row["ours"]["total"]
    got = (torch_total["launches"], ours_total["launches"], ours_total["triton"])
    assert got == (GENERIC if route == "generic" else TRITON)[name], row
    assert ours_total["syncs"] == torch_total["syncs"]  # the optimizer's own host reads, no more
    logged = SHAPES[name].logger
    assert row["logged"] == (bench_host.RECORDS_PER_COPY + 4 if logged else 0)  # every step's record, none without
    if not logged:
        assert row["ours"]["update"]["launches"] == 1  # _amp_update_scale_: the record's scale is computed on the host
    if not logged:  # with Triton (CUDA builds) or without: never more launches than torch's scaler
        assert ours_total["launches"] + ours_total["triton"] <= torch_total["launches"]
    assert row["same"] or SHAPES[name].clip == "scaler"  # a one-pass clip rounds its norm differently


def test_the_host_section_formats_every_cell() -> None:
    said: list[str] = []
    rows = bench_host.host_section(steps=2, warmup=0, shapes=[SHAPES["mlp adamw"]], progress=said.append)
    assert said == ["bench: host: mlp adamw (generic) 1/1"]
    lines = bench_host.format_host(rows)
    assert any(line.startswith("| mlp adamw | generic | 8 |") for line in lines)
    assert any(line.endswith("| ratio | whole | same |") for line in lines)
    ratio = rows[0]["time_ratio"]
    assert ratio["whole"] > 0
    assert f"| {ratio['whole']:.2f} | yes |" in lines[-1]  # every step counted, beside the median
    assert rows[0]["ours"]["update"]["launches"] == 1  # the warm-up is raised to the telemetry's steady state


# shape -> ours' Python calls per step minus torch's (``bench_host.python_calls``; benchmarks/python_calls.py prints
# every row): the host work outside the ops, counted (at 147 tensors: a loop per tensor). A count that rises fails
# here; one that falls lowers its number.
PYTHON_CALLS = {"mlp adamw": 29, "mlp adamw + masters": 104, "gpt adamw + masters": -452}
PINNED_TORCH = "2.13.0"  # the release the README's set-up installs, whose scaler and optimizers these counts include
COUNTED_ON = (3, 11)  # Python 3.12 inlines comprehensions: fewer calls, by a number that differs between the two
# Counted in a process of its own: what earlier tests leave installed for the process (Dynamo's wrappers after a
# compile, gradscaler's zero_grad patch after float32 sums) adds calls to both, not always as many to each.
_COUNT = """
import json, sys
from gradscaler.tools import bench_host
shape = next(s for s in bench_host.SHAPES if s.name == sys.argv[1])
counts = [bench_host.python_calls(shape, ours) for ours in (False, True)]
counts.append(bench_host.python_calls(shape, True, steps=bench_host.RECORDS_PER_COPY))
print(json.dumps(counts))
"""


@pytest.mark.skipif(
    not torch.__version__.startswith(PINNED_TORCH) or sys.version_info[:2] != COUNTED_ON,
    reason=f"counted with torch {PINNED_TORCH} on Python {COUNTED_ON[0]}.{COUNTED_ON[1]}",
)
@pytest.mark.parametrize("name", sorted(PYTHON_CALLS))
def test_python_calls_per_step(name: str) -> None:
    result = subprocess.run([sys.executable, "-c", _COUNT, name], capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    theirs, ours, ours_again = json.loads(result.stdout.strip().splitlines()[-1])
    assert ours_again == ours  # exact counts: the same mean over 16 steps as over 32
    assert ours - theirs <= PYTHON_CALLS[name], (theirs, ours)


def test_a_casting_reduction_counts_its_hidden_cast() -> None:
    """``sum(dtype=)`` of another dtype launches a cast inside ATen, below any dispatch mode: counted as one."""
    values = torch.ones(3, dtype=torch.float64)
    for call, launches in [
        (lambda: values.sum(dtype=torch.float32), 2),
        (lambda: values.sum(), 1),
        (lambda: values.half().sum(dtype=torch.float32), 2),  # the half() and the sum: no cast on CUDA
    ]:
        counts = host_counts.Counts()
        with counts:
            call()
        assert sum(counts.ops.values()) == launches, counts.ops


@pytest.mark.parametrize(("route", "kernel"), [("native", None), ("torch-ops", "torch")])
def test_the_routes_on_the_device_leave_the_scaler_its_own(
    monkeypatch: pytest.MonkeyPatch, route: str, kernel: str | None
) -> None:
    """``route="native"`` and ``"torch-ops"`` (``make gpu-check``'s host step, on CUDA: with Triton, without) run
    each scaler as a user's would: here the CPU route proper, whose flag is read on the host for free (more host
    reads than torch's, no more launches)."""
    monkeypatch.delenv("GRADSCALER_KERNEL", raising=False)
    with bench_host.device_route(route):
        assert os.environ.get("GRADSCALER_KERNEL") == kernel
    assert "GRADSCALER_KERNEL" not in os.environ
    shape = SHAPES["mlp fused + scaler clip"]
    row = bench_host.measure(shape, steps=2, warmup=bench_host.RECORDS_PER_COPY + 2, route=route)
    assert (row["route"], row["device"]) == (route, "cpu")
    torch_total, ours_total = row["torch"]["total"], row["ours"]["total"]
    assert ours_total["syncs"] > torch_total["syncs"] == 0  # the CPU route's reads; the generic route makes none
    assert ours_total["launches"] <= torch_total["launches"]
    assert "GRADSCALER_KERNEL" not in os.environ
    lines = bench_host.format_host([row])
    assert any(line.startswith(f"| mlp fused + scaler clip | {route}, cpu | 8 |") for line in lines)


def test_a_stand_in_route_runs_on_the_cpu_only() -> None:
    with pytest.raises(
        ValueError, match="route='generic' stands for CUDA on the CPU; on cuda measure route='native' or"
    ):
        bench_host.measure(SHAPES["mlp adamw"], steps=1, warmup=0, device=torch.device("cuda"))


def test_the_bench_on_a_gpu_measures_both_routes_there(monkeypatch: pytest.MonkeyPatch) -> None:
    """``gradscaler bench --device cuda --sections host`` (``make gpu-check``'s host step): the rows of the scaler's
    own route and of torch's ops, on the GPU; none of the CPU's stand-ins (whose ops are CUDA's, not the GPU's)."""
    from gradscaler.tools import bench

    calls: list[tuple[str, str]] = []

    def section(
        steps: int, warmup: int, route: str = "generic", device: torch.device | None = None, progress: object = None
    ) -> list[dict[str, str]]:
        assert progress is not None  # each shape announced: a GPU's minutes show where they go
        calls.append((route, str(device)))
        return [{"route": route}]

    monkeypatch.setattr(bench_host, "host_section", section)
    monkeypatch.setattr(bench_host, "triton_rows", lambda progress: pytest.fail("the interpreter's rows on a GPU"))
    monkeypatch.setattr(bench, "environment", lambda device: {"device": str(device)})
    results = bench.run("cuda", 5, 1, ["host"], progress=lambda line: None)
    assert calls == [("native", "cuda"), ("torch-ops", "cuda")]
    assert [row["route"] for row in results["host"]] == ["native", "torch-ops"]
    calls.clear()
    monkeypatch.setattr(bench_host, "triton_rows", lambda progress: [])
    bench.run("cpu", 5, 1, ["host"], progress=lambda line: None)
    assert calls == [("generic", "None")]  # the CPU: CUDA's ops dispatched here


def test_device_work_counts_what_the_profiler_saw_and_runs_the_call_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """On CUDA the host step counts, beside the dispatcher's ops, what the device ran (``device_work``): here the
    same mechanics with the CPU's events. A profiler that cannot start leaves the count unknown, not the step."""
    ran: list[int] = []

    def call() -> torch.Tensor:
        ran.append(1)
        return (torch.ones(3) * 2).sum()

    result, seen = host_counts.device_work(call, "cpu")
    assert float(result) == 6.0 and seen is not None and seen >= 2  # at least the multiply and the sum
    ran.clear()
    assert host_counts.device_work(call, None)[1] is None and len(ran) == 1  # not profiled

    def refuse(*args: object, **kwargs: object) -> None:
        raise RuntimeError("no profiler here")

    monkeypatch.setattr(torch.profiler, "profile", refuse)
    ran.clear()
    result, seen = host_counts.device_work(call, "cuda")
    assert (float(result), seen, len(ran)) == (6.0, None, 1)


def test_the_device_work_table_follows_when_a_profiler_counted() -> None:
    rows = bench_host.host_section(steps=2, warmup=0, shapes=[SHAPES["mlp adamw"]])
    assert rows[0]["ours"]["total"]["device_kernels"] is None  # the CPU: no device profiler in the count
    assert not any("device work" in line for line in bench_host.format_host(rows))
    rows[0]["torch"]["total"]["device_kernels"], rows[0]["ours"]["total"]["device_kernels"] = 25, 19
    lines = bench_host.format_host(rows)
    assert lines[-1] == "| mlp adamw | generic | 25 / 19 |"


def test_device_work_on_cuda_counts_the_device_events_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA branch with a stand-in profiler (no GPU here): CUDA's activity asked for, the device drained before
    the profiler stops, and only the events on the device counted (the host's ops are not launches)."""
    asked: list[object] = []
    order: list[str] = []

    class Event:
        def __init__(self, device_type: object) -> None:
            self.device_type = device_type

    class Session:
        def __init__(self, activities: list[object]) -> None:
            asked.extend(activities)

        def __enter__(self) -> Session:
            return self

        def __exit__(self, *exc: object) -> None:
            order.append("stopped")

        def events(self) -> list[Event]:
            cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU
            return [Event(cuda), Event(cpu), Event(cuda), Event(cpu), Event(cuda)]

    monkeypatch.setattr(torch.profiler, "profile", Session)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *device: order.append("drained"))
    result, seen = host_counts.device_work(lambda: order.append("ran") or 7, "cuda")
    assert (result, seen) == (7, 3)
    assert torch.profiler.ProfilerActivity.CUDA in asked
    assert order == ["ran", "drained", "stopped"]


def _counted(monkeypatch: pytest.MonkeyPatch, without: list[tuple[Any, str, Any]]) -> dict[str, int]:
    """Each check of ``without`` wrapped to count its calls, where it is: the calls the library makes of it."""
    calls = dict.fromkeys((name for _, name, _ in without), 0)
    for owner, name, _ in without:
        original = vars(owner)[name]

        def counting(*args: Any, _name: str = name, _original: Any = original, **kwargs: Any) -> Any:
            calls[_name] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(owner, name, counting)
    return calls


def test_the_checks_bench_replaces_each_check_where_the_library_reads_it(monkeypatch: pytest.MonkeyPatch) -> None:
    """benchmarks/masters_checks.py: every check it names is one the step calls, through the name it replaces (a
    check renamed, or replaced where the library does not read it, would leave its row measuring it), and none is
    called while replaced but the binding, once for the optimizer; each is put back after; the run stays the
    recipe's, bit for bit."""
    module = load_benchmark("masters_checks")
    calls = _counted(monkeypatch, module.WITHOUT)
    counting = [vars(owner)[name] for owner, name, _ in module.WITHOUT]
    shape = next(s for s in bench_host.SHAPES if s.name == "mlp adamw + masters")
    assert bench_host.measure(shape, 4, 2)["same"]
    assert all(calls.values()), calls  # each one reached as shipped
    calls.update(dict.fromkeys(calls, 0))
    with module.without_checks():
        assert bench_host.measure(shape, 4, 2)["same"]
    assert calls == {**dict.fromkeys(calls, 0), "_bind": 1}, calls
    assert [vars(owner)[name] for owner, name, _ in module.WITHOUT] == counting


def test_the_checks_bench_leaves_a_clipped_run_as_it_was() -> None:
    """With the scaler's clip (whose one-pass norms round apart from the recipe's clip), the run without the checks
    is the run with them, bit for bit."""
    module = load_benchmark("masters_checks")
    shape = bench_host.HostShape(clip="scaler", masters=True)
    runs = []
    for context in (contextlib.nullcontext(), module.without_checks()):
        with context:
            loop = bench_host.Loop(shape, ours=True)
            for _ in range(6):
                loop.step(False)
        runs.append(loop.state())
    assert all(torch.equal(a, b) for a, b in zip(*runs, strict=True))


def test_the_checks_bench_puts_each_check_back_after_an_error() -> None:
    module = load_benchmark("masters_checks")
    shipped = [vars(owner)[name] for owner, name, _ in module.WITHOUT]
    with pytest.raises(RuntimeError, match="inside"), module.without_checks():
        raise RuntimeError("inside")
    assert [vars(owner)[name] for owner, name, _ in module.WITHOUT] == shipped


def test_the_checks_bench_refuses_a_check_that_is_gone(monkeypatch: pytest.MonkeyPatch) -> None:
    module = load_benchmark("masters_checks")
    owner, name, _ = module.WITHOUT[0]
    shipped = vars(owner)[name]
    monkeypatch.setattr(module, "WITHOUT", [*module.WITHOUT, (owner, "no_such_check", lambda _: None)])
    with pytest.raises(KeyError, match="no_such_check"), module.without_checks():
        pass
    assert vars(owner)[name] is shipped and not hasattr(owner, "no_such_check")
