"""record/monitor.py on its own: loggers, collapse detection and attribution from values, no GradScaler."""

from __future__ import annotations

import copy
import json
import pickle
import weakref

import pytest
import torch

from gradscaler.errors import ScaleCollapseError, ScaleCollapseWarning
from gradscaler.record.monitor import JsonLinesLogger, Monitor
from gradscaler.record.telemetry import Landed
from gradscaler.rule import ScaleRule

RULE = ScaleRule()


def landed(collapse_run: int = 0, scale: float = 1.0, tag: object = None) -> list[Landed]:
    counters = {"skipped_steps": collapse_run, "consecutive_skips": collapse_run, "growths": 0, "backoffs": 0,
                "collapse_run": collapse_run, "scale": scale}  # fmt: skip
    return [Landed(counters, collapse_run > 0, False, tag, None)]


def update(monitor: Monitor, optimizers: list | None = None, found: float = 0.0) -> list[Landed]:
    """One update fed to ``monitor`` as a scaler would; returns its record as the telemetry would land it."""
    tag, carry = monitor.record_update([{"optimizer": ref} for ref in optimizers or []], torch.tensor(found), RULE)
    assert carry is None  # the CPU: names are resolved at update()
    return landed(tag=tag)


def test_loggers_run_every_n_updates_with_the_step() -> None:
    monitor, seen = Monitor(collapse_patience=None), []
    monitor.add_logger(seen.append, every=2)
    for _ in range(4):
        monitor.after_update(update(monitor))
    assert [record["step"] for record in seen] == [2, 4]
    assert "policy" in seen[0] and "policy" not in seen[1]


def test_nothing_lands_nothing_runs() -> None:
    monitor, seen = Monitor(), []
    monitor.add_logger(seen.append)
    monitor.after_update([])
    assert seen == []


def test_collapse_raises_once_per_episode_naming_the_bad_parameter() -> None:
    param = torch.nn.Parameter(torch.zeros(4, 3))
    param.grad = torch.full((4, 3), float("inf"))
    opt = torch.optim.SGD([param], lr=0.1)
    monitor = Monitor(collapse_patience=3)
    monitor.name_parameters([("encoder.weight", param)])
    update(monitor, [weakref.ref(opt)])
    monitor.after_update(landed(2))
    with pytest.raises(ScaleCollapseError, match=r"3 consecutive .* encoder\.weight"):
        monitor.after_update(landed(3, 2.0**-126))
    monitor.after_update(landed(4))  # same episode: reported already
    monitor.after_update(landed(0))
    with pytest.raises(ScaleCollapseError):
        monitor.after_update(landed(3))


def test_collapse_warns_with_unnamed_parameters_by_position() -> None:
    param = torch.nn.Parameter(torch.zeros(2))
    param.grad = torch.tensor([1.0, float("nan")])
    opt = torch.optim.SGD([param], lr=0.1)
    monitor = Monitor(collapse_patience=1, on_collapse="warn")
    update(monitor, [weakref.ref(opt)])
    with pytest.warns(ScaleCollapseWarning, match=r"param_groups\[0\]\[0\] \(2,\)"):
        monitor.after_update(landed(1))


def test_sparse_and_complex_gradients_are_attributed() -> None:
    sparse = torch.nn.Parameter(torch.zeros(5, 2, dtype=torch.float16))
    sparse.grad = torch.sparse_coo_tensor([[1, 1]], torch.tensor([[6e4, 0.0], [6e4, 0.0]]).half(), (5, 2))
    cplx = torch.nn.Parameter(torch.zeros(2, dtype=torch.complex64))
    cplx.grad = torch.tensor([1 + 1j, complex(0, float("inf"))], dtype=torch.complex64)
    opt = torch.optim.SGD([sparse, cplx], lr=0.1)
    monitor = Monitor()
    update(monitor, [weakref.ref(opt)])
    assert monitor.nonfinite_parameters() == ["param_groups[0][0] (5, 2)", "param_groups[0][1] (2,)"]


def test_last_grad_norms_are_labelled() -> None:
    a, b = torch.zeros(3), torch.zeros(2)
    monitor = Monitor()
    monitor.name_parameters([("a", a)])
    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)  # the key: held weakly
    monitor.grad_norms[optimizer] = [([a, b], torch.tensor([2.0, 1.0]))]
    assert monitor.last_grad_norms() == {"a": 2.0, "parameter 1 (2,)": 1.0}


def test_pickle_drops_process_local_state_and_deepcopy_keeps_it(tmp_path) -> None:
    monitor = Monitor(collapse_patience=None, steps=5)
    logger = JsonLinesLogger(tmp_path / "log.jsonl")
    monitor.add_logger(logger)
    w = torch.zeros(1)  # names are held weakly by their parameter
    monitor.name_parameters([("w", w)])
    pickled = pickle.loads(pickle.dumps(monitor))
    assert (pickled.steps, pickled.loggers, dict(pickled.param_names)) == (5, [], {})
    copied = copy.deepcopy(monitor)
    assert copied.loggers == monitor.loggers and copied.label(w, "") == "w"
    copied.after_update(update(copied))
    assert json.loads((tmp_path / "log.jsonl").read_text())["step"] == 6


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"on_collapse": "ignore"}, "on_collapse must be 'raise' or 'warn'"), ({"collapse_patience": 0}, ">= 1 or None")],
)
def test_bad_settings_are_refused(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Monitor(**kwargs)
