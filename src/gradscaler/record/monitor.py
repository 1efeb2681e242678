"""Host-side reporting for one scaler: loggers, parameter names, overflow attribution, collapse detection.

``telemetry`` keeps the device counters; this module decides what to tell the user about them. A
``Monitor`` is fed values by its scaler (records that have landed on the host, the optimizers of
the last iteration, the clipping pass's norms) and never sees the scaler itself.

Attribution for the log (which parameters overflowed at a logged step) reads no tensor back on the
device path: the per-tensor results of the iteration's read pass (the clipping norms; for a fused
optimizer's check, the inf-norms its pass yields in the same one read) are carried to the host with
the step's record (``Telemetry.record_``) and turned into names once landed. An optimizer whose
gradients were checked by torch's unscale kernel (one flag, nothing per tensor) gets one more
read-only pass, on logged steps only. On the CPU, where host reads are free, the gradients of a
skipped step are read again instead, at ``update()``.
"""

from __future__ import annotations

import copy
import json
import math
import os
import uuid
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch.utils.weak import WeakIdKeyDictionary

from gradscaler import grads
from gradscaler.errors import COLLAPSE_CAUSES, ScaleCollapseError, ScaleCollapseWarning, warn
from gradscaler.grads import WeakById, checkable_view
from gradscaler.kernels import host_reads_free, moved
from gradscaler.record.telemetry import COUNTERS, Landed
from gradscaler.rule import INT64_MAX, ScaleRule

Logger = Callable[[dict[str, Any]], None]
NormRecord = tuple[list[torch.Tensor], torch.Tensor]
"""Parameters of one device and the norms of their unscaled gradients (1-d, on the device)."""

ON_COLLAPSE = ("raise", "warn")
SHOWN_NAMES = 20
LOG_VERSION = 2
"""The ``"version"`` of the records loggers receive (see ``JsonLinesLogger``)."""

OptimizerRef = weakref.ReferenceType[torch.optim.Optimizer]


class _Tag(NamedTuple):
    """What the host keeps for a logged step until its record lands.

    ``names``: the non-finite parameters, when known at ``update()`` (the CPU); else ``params``, one
    per carried per-tensor value (a non-finite value marks a non-finite gradient), and ``optimizers``
    to label them. ``norm``: the clipping norm, or ``carried_norm`` when it is the last carried value.
    """

    step: int
    rule: ScaleRule
    names: list[str] | None
    params: list[torch.Tensor]
    optimizers: list[OptimizerRef]
    norm: float | None
    carried_norm: bool


class Monitor:
    """What one scaler reports, and the host-side state it needs to do so.

    ``steps`` counts completed ``update()`` calls. Loggers, parameter names, the last iteration's
    optimizers (weak references) and the clipping norms are per process: pickling drops them,
    ``copy.deepcopy`` keeps them (see ``__getstate__`` and ``__deepcopy__``). Names and norms are
    keyed weakly by the parameter and the optimizer themselves: they keep nothing alive, and go with
    their key (a new object at a dead one's address inherits nothing). A module named whole is held
    weakly and named when a report asks, while it lives, holding no reference to its parameters (torch's
    ``swap_tensors``, which ``model.float()`` calls under the swap-tensors future, refuses a weakly
    referenced parameter).
    """

    def __init__(
        self,
        collapse_patience: int | None = 50,
        on_collapse: str = "raise",
        steps: int = 0,
        stands_for: Callable[[torch.Tensor], torch.Tensor | None] | None = None,
    ) -> None:
        if on_collapse not in ON_COLLAPSE:
            raise ValueError(f"on_collapse must be 'raise' or 'warn', got {on_collapse!r}.")
        if collapse_patience is not None and (
            isinstance(collapse_patience, bool) or not isinstance(collapse_patience, int) or collapse_patience < 1
        ):
            raise ValueError(f"collapse_patience must be an int >= 1 or None, got {collapse_patience!r}.")
        self.collapse_patience = collapse_patience
        self.on_collapse = on_collapse
        self.steps = steps
        self.loggers: list[tuple[Logger, int]] = []
        self.param_names: WeakIdKeyDictionary = WeakIdKeyDictionary()  # parameter -> name, given in pairs
        self.named_modules: list[weakref.ReferenceType[torch.nn.Module]] = []  # given whole
        self.stands_for = stands_for  # a tensor the optimizer steps -> the model parameter it stands for
        self.grad_norms: WeakById[list[NormRecord]] = WeakById()  # by optimizer
        self._last_records: Sequence[Mapping[str, Any]] = []  # the last update's per-optimizer records
        self._collapse_reported_at = -1
        self._reads: dict[int, list[NormRecord]] = {}  # this iteration's per-tensor results, by optimizer
        self._norm: torch.Tensor | None = None  # this iteration's last clipping norm
        self._policies: dict[int, ScaleRule] = {}  # the policy each logger (by position) was last sent
        self._on_host: bool | None = None  # whether the scale's device reads for free (see kernels)

    @property
    def last_optimizers(self) -> list[OptimizerRef]:
        """The optimizers the last update's records name (weak references), read from the records when asked."""
        return [r["optimizer"] for r in self._last_records if "optimizer" in r]

    @property
    def wants_counters(self) -> bool:
        """Whether ``after_update`` has anything to do with landed counters."""
        return bool(self.loggers) or self.collapse_patience is not None

    def add_logger(self, callback: Logger, every: int = 1) -> None:
        """Call ``callback(record)`` every ``every`` updates (see ``GradScaler.add_logger``)."""
        if not callable(callback):
            raise TypeError(f"callback must be callable, got {type(callback).__name__}.")
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"every must be an int >= 1, got {every!r}.")
        self.loggers.append((callback, every))

    def name_parameters(self, named: torch.nn.Module | Iterable[tuple[str, torch.Tensor]]) -> None:
        """Remember a module's parameter names (``named_parameters()`` when a report asks), or ``name`` for
        each ``(name, parameter)``."""
        if isinstance(named, torch.nn.Module):
            self.named_modules = [ref for ref in self.named_modules if ref() not in (None, named)]
            self.named_modules.append(weakref.ref(named))
            return
        for name, param in named:
            self.param_names[param] = name

    def names(self) -> dict[int, str]:
        """``id`` -> name of each parameter of the modules named whole, alive now (the ids hold while the
        caller holds the parameters it asks about)."""
        out: dict[int, str] = {}
        for ref in self.named_modules:
            module = ref()
            if module is not None:
                out.update((id(param), name) for name, param in module.named_parameters())
        return out

    def label(self, param: torch.Tensor, where: str, names: dict[int, str] | None = None) -> str:
        """The parameter's name (a master's: its model parameter's), or ``where`` and its shape when unnamed;
        ``names``: ``names()``, when the caller labels many."""
        names = self.names() if names is None else names
        name = self.param_names.get(param) or names.get(id(param))
        if name is None and self.stands_for is not None and (model_param := self.stands_for(param)) is not None:
            name = self.param_names.get(model_param) or names.get(id(model_param))
        return name or f"{where} {tuple(param.shape)}"

    def clipped(
        self,
        optimizer: torch.optim.Optimizer,
        owners: grads.Owners,
        norms: dict[torch.device, torch.Tensor],
        total: torch.Tensor,
    ) -> None:
        """Keep a clipping pass's per-tensor norms (of ``owners``' gradients, in that order) and total."""
        self.grad_norms[optimizer] = self._reads[id(optimizer)] = _per_device(owners, norms)
        self._norm = total

    def nonfinite_flags(
        self, optimizer: torch.optim.Optimizer, params: list[torch.Tensor], complete: bool = True
    ) -> dict[torch.device, torch.Tensor]:
        """``grads.nonfinite_flags`` of ``params``' gradients (read only). With a logger on the device
        path it runs as an inf-norm pass, the same one read, whose per-tensor results are kept when
        ``params`` are all of ``optimizer``'s (``complete``; else a logged update reads them all)."""
        owners = grads.new_groups() if self.loggers and complete else None
        groups = grads.group_grads(params, allow_fp16=True, owners=owners)
        if owners is None or all(map(host_reads_free, groups)):
            return grads.nonfinite_flags(groups)
        peaks, flags = grads.norms_and_check(groups, math.inf)
        self._reads[id(optimizer)] = _per_device(grads.flat_owners(owners), peaks)
        return flags

    def record_update(
        self, records: Sequence[Mapping[str, Any]], found: torch.Tensor, rule: ScaleRule
    ) -> tuple[_Tag | None, torch.Tensor | None]:
        """Count one completed update (``found``: its overflow flag) and remember the optimizers of its
        per-optimizer ``records`` (their ``"optimizer"`` weak references).

        Returns what the telemetry carries with this step's record when a logger will log it: a host
        tag and, on the device path, a device tensor of per-tensor results (and the clipping norm). No sync.
        """
        if self.steps < INT64_MAX:  # saturates: a state dict keeps a loadable count after any number of steps
            self.steps += 1
        self._last_records = records  # kept, not copied: the scaler starts a new list at each update
        reads, norm, clipped = self._reads, self._norm, self._norm is not None
        if reads:
            self._reads = {}
        self._norm = None
        if not self.loggers or not any(self.steps % every == 0 for _, every in self.loggers):
            return None, None
        optimizers = self.last_optimizers
        if self._on_host is None:  # the flag's device never changes: ask once (an environment read)
            self._on_host = host_reads_free(found.device)
        on_host = self._on_host
        if on_host and not found.item():  # a clean step, known for free: nothing to attribute
            return _Tag(self.steps, rule, [], [], optimizers, None if norm is None else norm.item(), False), None
        params: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        for ref in optimizers:
            optimizer = ref()
            if optimizer is None:
                continue
            for owned, results in reads.get(id(optimizer)) or self._read_pass(optimizer):
                params.extend(owned)
                values.append(moved(results, found.device, results.dtype))
        if norm is not None:
            values.append(moved(norm, found.device, norm.dtype).reshape(1))
        carry = (values[0] if len(values) == 1 else torch.cat(values)) if values else None  # nothing writes them
        tag = _Tag(self.steps, rule, None, params, optimizers, None, clipped)
        if not on_host:
            return tag, carry
        landed = carry.tolist() if carry is not None else []  # free on the CPU
        names = self._resolve(tag, landed)
        return tag._replace(names=names, params=[], norm=landed[-1] if clipped else None, carried_norm=False), None

    def _read_pass(self, optimizer: torch.optim.Optimizer) -> list[NormRecord]:
        """Per-tensor inf-norms of ``optimizer``'s gradients as stored (read only, no sync), for an
        optimizer whose gradients were checked by torch's unscale kernel (a finite factor: whatever was
        non-finite still is)."""
        owners = grads.new_groups()
        groups = grads.group_grads(list(grads.iter_params(optimizer)), allow_fp16=True, owners=owners)
        return _per_device(grads.flat_owners(owners), grads.peaks(groups))

    def after_update(self, landed: list[Landed]) -> None:
        """Feed loggers and detect collapse from records that have landed on the host, oldest first (no sync).

        Raises ``ScaleCollapseError`` (or warns) once per collapse, after ``collapse_patience``
        consecutive overflowing steps at the minimum scale, once every landed record is logged.
        """
        collapse = None
        for item in landed:
            if item.tag is not None:
                self._log(item, item.tag)
            run = item.counters["collapse_run"]
            if self.collapse_patience is None or run < self.collapse_patience:
                self._collapse_reported_at = -1
            elif self._collapse_reported_at < 0:
                self._collapse_reported_at = self.steps
                collapse = self._collapse_message(run, item.counters["scale"])
        if collapse is None:
            return
        if self.on_collapse == "raise":
            raise ScaleCollapseError(collapse)
        warn(collapse, ScaleCollapseWarning)

    def _log(self, item: Landed, tag: _Tag) -> None:
        """Build the record of one landed step and give it to the loggers due at that step."""
        record: dict[str, Any] = {"step": tag.step, **item.counters, "version": LOG_VERSION, "skipped": item.skipped}
        carried = item.carried
        if item.skipped or item.changed:
            names = tag.names
            if names is None:
                names = self._resolve(tag, carried.tolist() if carried is not None else [])
            record["nonfinite"] = names[:SHOWN_NAMES]
            if len(names) > SHOWN_NAMES:
                record["nonfinite_more"] = len(names) - SHOWN_NAMES
        # the norm alone, on most steps: not one float per parameter (tolist: a host copy, not a sync)
        norm = carried[-1:].tolist()[0] if tag.carried_norm and carried is not None else tag.norm
        if norm is not None:
            record["grad_norm"] = norm
        for position, (callback, every) in enumerate(self.loggers):
            if tag.step % every:
                continue
            if self._policies.get(position) is not tag.rule:  # a new rule object: a setter or a load ran
                self._policies[position] = tag.rule
                callback({**record, "policy": policy_record(tag.rule)})
            else:
                callback(record)

    def _resolve(self, tag: _Tag, values: list[float]) -> list[str]:
        """Names of the parameters whose carried value is not finite, labelled as ``nonfinite_parameters`` does."""
        bad = [p for p, v in zip(tag.params, values, strict=False) if not math.isfinite(v)]
        if not bad:
            return []
        where: dict[int, str] = {}
        for ref in tag.optimizers:
            optimizer = ref()
            for gi, group in enumerate(optimizer.param_groups if optimizer is not None else []):
                for pi, param in enumerate(group["params"]):
                    where.setdefault(id(param), f"param_groups[{gi}][{pi}]")
        names = self.names()
        return [self.label(p, where.get(id(p), "parameter"), names) for p in bad]

    def _collapse_message(self, run: int, scale: float) -> str:
        names = self.nonfinite_parameters()
        shown = ", ".join(names[:SHOWN_NAMES])
        if len(names) > SHOWN_NAMES:
            shown += f" and {len(names) - SHOWN_NAMES} more"
        return (
            f"Loss scale collapsed at step {self.steps}: {run} consecutive overflowing steps at the minimum "
            f"scale {scale:g}; every one of them was skipped. Parameters with non-finite gradients "
            f"now: {shown or 'none (the gradients of the current step are finite)'}. {COLLAPSE_CAUSES} "
            "Call scaler.name_parameters(model) for names; pass on_collapse='warn' or collapse_patience=None "
            "to keep training."
        )

    def nonfinite_parameters(self) -> list[str]:
        """Names of the last iteration's parameters whose gradients hold inf or NaN (one sync)."""
        labelled: list[tuple[str, torch.Tensor]] = []
        names = self.names()
        for ref in self.last_optimizers:
            optimizer = ref()
            if optimizer is None:
                continue
            for gi, group in enumerate(optimizer.param_groups):
                for pi, param in enumerate(group["params"]):
                    if param.grad is None:
                        continue
                    finite = torch.isfinite(checkable_view(param.grad)).all()
                    labelled.append((self.label(param, f"param_groups[{gi}][{pi}]", names), finite.logical_not().cpu()))
        if not labelled:
            return []
        bad = torch.stack([flag for _, flag in labelled]).tolist()
        return [name for (name, _), is_bad in zip(labelled, bad, strict=True) if is_bad]

    def last_grad_norms(self) -> dict[str, float]:
        """Unscaled per-parameter norms recorded by the last clipping pass of each optimizer (one sync)."""
        out: dict[str, float] = {}
        names = self.names()
        for records in self.grad_norms.values():
            for params, norms in records:
                values = norms.tolist()
                labels = [self.label(p, f"parameter {i}", names) for i, p in enumerate(params)]
                out.update(zip(labels, values, strict=True))
        return out

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state.update(loggers=[], param_names=None, grad_norms=None, _last_records=[], _reads={}, _norm=None)
        state.update(named_modules=[])
        state.update(_policies={}, _on_host=None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        state = {k: v for k, v in state.items() if k != "last_optimizers"}  # older pickles: now read from the records
        self.__dict__.update(state, param_names=WeakIdKeyDictionary(), grad_norms=WeakById(), named_modules=[])
        self.__dict__.setdefault("_last_records", [])

    def __deepcopy__(self, memo: dict[int, Any]) -> Monitor:
        """A copy that keeps loggers (the same callbacks) and parameter names, unlike a pickle."""
        new = copy.copy(self)
        new.loggers = list(self.loggers)
        new.param_names = WeakIdKeyDictionary(self.param_names)
        new.named_modules = list(self.named_modules)
        new.stands_for = copy.deepcopy(self.stands_for, memo)  # the copied scaler's masters
        new.grad_norms = WeakById()
        new._last_records = []
        new._reads, new._norm, new._policies = {}, None, dict(self._policies)
        return new


def _per_device(owners: grads.Owners, results: dict[torch.device, torch.Tensor]) -> list[NormRecord]:
    """Per-device per-tensor ``results`` with the parameters they belong to, in the same order."""
    return [(owners[device], r) for device, r in results.items()]


def policy_record(rule: ScaleRule) -> dict[str, Any]:
    """The ``"policy"`` object of a log record."""
    return {
        "growth_factor": rule.growth_factor,
        "backoff_factor": rule.backoff_factor,
        "growth_interval": rule.growth_interval,
        "hysteresis": rule.hysteresis,
        "min_scale": rule.min_scale,
        "max_scale": rule.max_scale,
    }


class JsonLinesLogger:
    """A ``GradScaler.add_logger`` callback that appends one JSON object per call to ``path``.

    Each line describes the state after one ``update()`` (log version 2; docs/log-format.md):

    * ``step``: the number of completed ``update()`` calls the record describes (on CUDA it is
      written one update later, but names the update it describes).
    * ``scale``: the scale after that update. ``skipped_steps``, ``consecutive_skips``, ``growths``,
      ``backoffs``, ``collapse_run``: the counters, as ``stats()`` gives them.
    * ``version``: 2. ``skipped``: whether that update saw a non-finite gradient (its step was skipped).
    * ``nonfinite``: on a step that was skipped or changed the scale, the names (from
      ``name_parameters``; else ``param_groups[i][j] (shape)``) of the parameters whose gradients
      were non-finite, at most 20 (``nonfinite_more``: how many more). Empty on a growth.
    * ``grad_norm``: when ``clip_grad_norm_`` ran in that step, the total unscaled norm it returned
      (NaN or Infinity on an overflowing step; the last clipped optimizer's when several were).
    * ``policy``: on the first record and after any change, ``growth_factor``, ``backoff_factor``,
      ``growth_interval``, ``hysteresis``, ``min_scale``, ``max_scale`` (null when unset).
    * ``rank`` and ``run``: the writer, so that a reader tells apart records that two writers put in
      one file: the process's rank under ``torch.distributed`` (else 0) and this logger's ``run``, a
      random id made when it is created.

    Under ``torch.distributed`` with several ranks, each rank writes its own file (``per_rank``, the
    default): rank 0 ``path`` itself, rank r ``<stem>.rank<r><suffix>`` beside it
    (``scaler.rank1.jsonl``); ``file`` is the one written, settled at the first record (the process
    group may be created after the logger). ``per_rank=False``: every rank appends to ``path``, and
    ``gradscaler report --rank R`` reads one rank's records. Readers should ignore keys they do not
    know; 0.1.0 logs hold the first seven fields only.
    """

    def __init__(self, path: str | Path, *, per_rank: bool = True) -> None:
        self.path = Path(path)
        self.per_rank = per_rank
        self.run = uuid.uuid4().hex[:12]
        self.rank: int | None = None
        self.file: Path | None = None

    def __call__(self, record: dict[str, Any]) -> None:
        if self.file is None:
            self.rank, self.file = self._writer()
        with self.file.open("a", encoding="utf-8") as handle:
            handle.write(json.dumps({**record, "rank": self.rank, "run": self.run}) + "\n")

    def _writer(self) -> tuple[int, Path]:
        """This process's rank and the file it writes (docs/log-format.md, "Several writers")."""
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        rank = torch.distributed.get_rank() if distributed else 0
        if not self.per_rank or rank == 0:
            return rank, self.path
        return rank, self.path.with_name(f"{self.path.stem}.rank{rank}{self.path.suffix}")


TENSORBOARD_KEYS = ("scale", *COUNTERS, "grad_norm")
"""The numbers of a record that ``TensorBoardLogger`` writes, each as ``amp/<key>``."""


class TensorBoardLogger:
    """A ``GradScaler.add_logger`` callback that writes a record's numbers as TensorBoard scalars.

    ``amp/scale``, ``amp/skipped_steps``, ``amp/consecutive_skips``, ``amp/growths``, ``amp/backoffs``,
    ``amp/collapse_run`` and, when the record has it, ``amp/grad_norm``, each at the record's
    ``"step"``. ``target`` is a log directory (a ``torch.utils.tensorboard.SummaryWriter`` is opened
    there; needs the ``tensorboard`` package) or any writer with ``add_scalar(tag, value, step)``
    (torch's ``SummaryWriter``, tensorboardX's), which the caller keeps and closes. ``prefix``
    replaces ``"amp/"``.
    """

    def __init__(self, target: str | os.PathLike[str] | Any, prefix: str = "amp/") -> None:
        if isinstance(target, (str, os.PathLike)):
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as error:
                raise ImportError(
                    f"TensorBoardLogger({os.fspath(target)!r}) writes with torch.utils.tensorboard, which needs the "
                    "tensorboard package: pip install tensorboard (or pass a SummaryWriter of your own)."
                ) from error
            self.writer = SummaryWriter(os.fspath(target))
        elif callable(getattr(target, "add_scalar", None)):
            self.writer = target
        else:
            raise TypeError(
                "TensorBoardLogger takes a log directory (str or path) or a writer with add_scalar(tag, value, step), "
                f"got {type(target).__name__}."
            )
        self.prefix = prefix

    def __call__(self, record: dict[str, Any]) -> None:
        step = record["step"]
        for key in TENSORBOARD_KEYS:
            if key in record:
                self.writer.add_scalar(self.prefix + key, record[key], step)

    def flush(self) -> None:
        """Write pending events to disk."""
        self.writer.flush()

    def close(self) -> None:
        """Flush and close the writer."""
        self.writer.close()
