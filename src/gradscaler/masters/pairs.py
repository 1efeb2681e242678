"""One low-precision parameter and its float32 master (``Pair``), and the masters of one optimizer (``Binding``).

A pair knows whether its parameter was written since the master was last equal to it rounded (its
version counter and storage), refreshes the master from it, and takes a master value loaded from a
checkpoint. A binding ends an iteration: the kept float16 gradients dropped.
``masters.MasterWeights`` builds them and steers them through the iteration.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Any

import torch

from gradscaler import grads
from gradscaler.masters import checkpoint
from gradscaler.masters.moved import dense

_PLAIN = (torch.Tensor, torch.nn.Parameter)
# read over whole lists in one C-level pass (``map``), not a bytecode loop per tensor: in a warm loop a third of a
# comprehension's time at 147 parameters; in the step, with cold caches, reaching each tensor costs the most
_VERSION, _EXACT = operator.attrgetter("_version"), operator.attrgetter("exact")
_SEEN_VERSION, _SEEN_STORAGE = operator.attrgetter("low_version"), operator.attrgetter("low_storage")


def _storage(tensor: torch.Tensor) -> int | None:
    """Where a plain tensor's values live (a ``p.data = ...`` moves it); None for subclasses (DTensor)."""
    return tensor.data_ptr() if type(tensor) in _PLAIN else None


def _storages(tensors: list[torch.Tensor], plain: bool = False) -> list[int | None]:
    """``_storage`` of each of ``tensors`` (no call per tensor); ``plain``: every one is a plain tensor."""
    if plain:
        return list(map(torch.Tensor.data_ptr, tensors))
    return [tensor.data_ptr() if type(tensor) in _PLAIN else None for tensor in tensors]


@dataclass
class Pair:
    """One low-precision parameter and its master, with what tells whether the parameter was written
    since the master was last equal to it rounded (its version counter and storage)."""

    low: torch.Tensor
    master: torch.Tensor
    low_version: int = -1
    low_storage: int | None = None
    held: Any = None  # the storage the parameter had when last seen, held: no new storage can take its address
    low_dtype: torch.dtype | None = None  # the parameter's dtype when it last equalled its master rounded
    pending: torch.Tensor | None = None  # a master value loaded from a checkpoint, checked at the next move
    kept: torch.Tensor | None = None  # the parameter's gradient after the user's ``unscale_``, until ``step``
    kept_version: int = 0
    exact: bool = True  # the parameter is its master rounded to its dtype, bit for bit (not after a cast)
    unsaved: bool = False  # a checkpoint loaded since carries no master for it: the next move takes its values

    def written(self) -> bool:
        """Whether the parameter may differ from its master rounded."""
        return self.low._version != self.low_version or _storage(self.low) != self.low_storage

    def seen(self) -> None:
        """Note the parameter's version and storage: it now equals its master rounded. The storage itself is
        held, so that a storage made later (a change of dtype and back: ``model.bfloat16()``, ``model.half()``)
        never gets its address, which ``written`` compares."""
        self.low_version = self.low._version
        storage = _storage(self.low)
        if storage is None:
            self.held = None
        elif storage != self.low_storage or self.held is None:
            self.held = self.low.untyped_storage()
        self.low_storage = storage
        self.low_dtype = self.low.dtype

    def refresh(self) -> None:
        """Make the master a loaded master value that rounds to the whole parameter as it is now, else the
        parameter's values wherever they are no rounding of the master (``_kept``): a model load of the same
        values keeps the master's precision, and so does a change of dtype (``model.float()``,
        ``model.bfloat16()``, a bfloat16 evaluation and back); then note the parameter's version and storage."""
        loaded = None if self.pending is None else checkpoint.claims(self.pending, self.low)
        if loaded is not None:
            self.master.copy_(loaded)
            self.note_exact()
        elif self.unsaved:  # the checkpoint's parameter had no master: its values were its master's
            self.master.copy_(self.low)
            self.exact = True
        else:
            self.master.copy_(torch.where(self._kept(), self.master, self.low.to(torch.float32)))
            # written in place in its dtype, the parameter is now its master rounded; after a cast it may be
            # a rounding through other dtypes, or its old values widened: a skipped step must leave it
            self.exact = self._same_storage() and self.low.dtype == self.low_dtype
        self.pending, self.unsaved = None, False
        self.seen()

    def note_exact(self) -> None:
        """Whether the parameter is its master rounded to its dtype (``exact``), read on the host: only where a
        checkpoint's master was just claimed, which read it already."""
        self.exact = torch.equal(self.master.detach().to(self.low.dtype), self.low.detach())

    def copy_back(self, skipped: torch.Tensor | None) -> None:
        """After a step: the parameter takes its master's values. ``skipped``: the device flag of a fused
        step, which may have skipped inside its kernel (not read on the host): a parameter that is no
        rounding of its master (``exact`` False) then keeps its values, as the recipe's skipped step does."""
        if skipped is None or self.exact:
            self.low.copy_(self.master)
            self.exact = True  # its master rounded, whether the step was applied or skipped
        else:
            flag = skipped.to(self.low.device, non_blocking=True).bool()
            self.low.copy_(torch.where(flag, self.low, self.master))
        self.seen()

    def _kept(self) -> torch.Tensor:
        """Where the parameter is a rounding of its master. Written in place (its storage and dtype as when last
        seen): the master rounded to that dtype. Given a new storage (a change of dtype, ``p.data = t``): the
        master rounded to its dtype now, directly or through the changes of dtype a loop makes between two
        moves (``checkpoint.rounds_to``)."""
        low = self.low.detach()
        if self._same_storage() and low.dtype == self.low_dtype:
            return self.master.to(low.dtype) == low
        return checkpoint.rounds_to(self.master, low)

    def _same_storage(self) -> bool:
        """Whether the parameter's values are in the storage it had when last seen (the storage itself, not
        one at the same address)."""
        if self.held is None:
            return _storage(self.low) == self.low_storage
        return bool(self.low.untyped_storage()._cdata == self.held._cdata)

    def load(self, value: torch.Tensor) -> None:
        """A master value from a checkpoint loaded into the optimizer: taken now if it rounds to the
        parameter everywhere (the model's checkpoint loaded first), and again at the next move against
        the parameter as it is then (the model's checkpoint loaded after the optimizer's)."""
        self.pending = value.detach().to(device=self.master.device, dtype=torch.float32, copy=True)
        self.unsaved = False
        loaded = checkpoint.claims(self.pending, self.low)
        if loaded is not None:
            self.master.copy_(loaded)
            self.note_exact()
        self.low_version = -1


@dataclass
class Binding:
    """The masters of one optimizer, whether this iteration's gradients are in them, and the hooks that
    carry them through its state dict. ``keys``, ``_lows``, ``_masters``, ``_plain`` and ``_others`` are derived
    from ``pairs`` for the step's comparisons of whole lists: pairs are added only through ``add``, which keeps
    them in step."""

    pairs: list[Pair] = field(default_factory=list)
    by_master: dict[int, Pair] = field(default_factory=dict)
    moved: bool = False
    hooks: list[Any] = field(default_factory=list)
    keys: list[int] = field(default_factory=list)  # id of each pair's parameter, in the order of ``pairs``
    routed: tuple[int, int] = (-1, -1)  # ``wrappers.open_routes``'s mark of the routes made for these pairs
    kept_any: bool = False  # a float16 gradient may be kept (``Pair.kept``): the user's ``unscale_``
    _lows: list[torch.Tensor] = field(default_factory=list)
    _masters: list[torch.Tensor] = field(default_factory=list)
    _plain: bool = True  # every parameter a plain tensor (no DTensor): one multi-tensor copy takes them all
    _params: grads.ParamList = field(default_factory=grads.ParamList)
    _others: tuple[list[torch.Tensor] | None, list[torch.Tensor]] = (None, [])  # (of which parameters, others)

    def add(self, pair: Pair) -> None:
        """A new pair (pairs are only ever added: a binding lives as long as its optimizer)."""
        self.pairs.append(pair)
        self.by_master[id(pair.master)] = pair
        self.keys.append(id(pair.low))
        self._lows.append(pair.low)
        self._masters.append(pair.master)
        self._plain = self._plain and type(pair.low) in _PLAIN
        self._others = (None, [])

    def others(self, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
        """The parameters of ``optimizer`` (this binding's) that are none of its masters; the same list while
        its param groups hold the same tensors and no pair was added (a float16 model's: empty)."""
        params = self._params.of(optimizer)
        of, others = self._others
        if of is not params:
            others = [p for p in params if id(p) not in self.by_master]
            self._others = (params, others)
        return others

    def lows(self) -> list[torch.Tensor]:
        """The parameters, in the order of ``pairs`` (the binding's own list: not to be changed)."""
        return self._lows

    def masters(self) -> list[torch.Tensor]:
        """The masters, in the order of ``pairs`` (the binding's own list: not to be changed)."""
        return self._masters

    def written(self) -> list[Pair]:
        """The pairs whose parameter may differ from its master rounded (``Pair.written``). Where none was
        written (every step of a loop that leaves its parameters to the optimizer) this is four
        passes over lists and two comparisons of lists, not a call per pair."""
        pairs, lows = self.pairs, self._lows
        if list(map(_VERSION, lows)) == list(map(_SEEN_VERSION, pairs)) and _storages(lows, self._plain) == list(
            map(_SEEN_STORAGE, pairs)
        ):
            return []
        return [pair for pair in pairs if pair.written()]

    def copy_back(self, skipped: torch.Tensor | None, pairs: list[Pair] | None = None) -> None:
        """``Pair.copy_back`` for every pair (or those of ``pairs``); the plain tensors that simply take their
        masters' values in one multi-tensor copy (one launch per device and dtype, not one per parameter).
        DTensors, which have no multi-tensor copy, and parameters a fused skip may keep, one by one."""
        if pairs is None and self._plain and (skipped is None or all(map(_EXACT, self.pairs))):
            pairs = plain = self.pairs  # the common step: every pair, in the binding's own lists
            lows, masters = self._lows, self._masters
        else:
            pairs = self.pairs if pairs is None else pairs
            if skipped is None:
                plain = [p for p in pairs if type(p.low) in _PLAIN]
            else:
                plain = [p for p in pairs if p.exact and type(p.low) in _PLAIN]
            lows, masters = [pair.low for pair in plain], [pair.master for pair in plain]
        if plain:
            before = _storages(lows, plain=True)
            torch._foreach_copy_(lows, masters)  # type: ignore[misc]
            _seen(plain, lows, before)
        if len(plain) == len(pairs):
            return
        copied = {id(pair) for pair in plain}
        for pair in pairs:
            if id(pair) not in copied:
                pair.copy_back(skipped)

    def restore(self, param: torch.Tensor, value: torch.Tensor) -> bool:
        """A saved master ``value`` loaded for the optimizer's parameter ``param``: taken if ``param`` is one
        of these masters (``Pair.load``); False if it is none."""
        pair = self.by_master.get(id(param))
        if pair is None:
            return False
        if value.shape == pair.master.shape:
            pair.load(value)
        return True

    def unsaved(self, params: list[torch.Tensor]) -> None:
        """A checkpoint loaded into the optimizer carries no master for these of its parameters (they had none
        when it was saved): each that is a master here takes its parameter's values at the next move, not
        its own where they round to them (the parameter's loaded values were its master's). Every other
        pair forgets an earlier load's such mark."""
        marked = {id(param) for param in params}
        for pair in self.pairs:
            pair.unsaved = id(pair.master) in marked
            if pair.unsaved:
                pair.pending, pair.low_version = None, -1

    def saved_value(self, param: torch.Tensor) -> torch.Tensor | None:
        """What a checkpoint saves for the optimizer's parameter ``param``: the master's value, or the loaded
        value it has not taken yet (the optimizer loaded before the model: taken at the next move); None
        when ``param`` is no master, or its master waits to take its parameter's values (``unsaved``: the
        checkpoint loaded last held none for it, and a save now holds none either)."""
        pair = self.by_master.get(id(param))
        if pair is None or pair.unsaved:
            return None
        return (pair.pending if pair.pending is not None else pair.master).detach()

    def saved_dtype(self, param: torch.Tensor) -> torch.dtype | None:
        """The dtype a checkpoint names for the optimizer's parameter ``param``'s master: its parameter's now;
        None when ``param`` is no master."""
        pair = self.by_master.get(id(param))
        return None if pair is None else pair.low.dtype

    def end(self) -> None:
        """The iteration is over: the next contact moves afresh (``masters`` also closes the clipping route)."""
        self.moved = False
        self.drop_kept()

    def after_move(self, moved: list[tuple[Pair, torch.Tensor]], keep: bool) -> None:
        """The parameters' gradients ``moved`` into their masters: kept until ``step`` after the user's own
        ``unscale_`` (``keep``; dense ones, which ``show`` writes), else dropped."""
        for pair, grad in moved:
            if keep and dense(grad):
                pair.kept, self.kept_any = grad, True
            else:
                pair.low.grad = None

    def zeroed_kept(self) -> None:
        """``optimizer.zero_grad(set_to_none=False)`` zeroed the masters' gradients and the kept float16
        ones alike: that write is no change the step would miss."""
        for pair in self.pairs:
            if pair.kept is not None and pair.low.grad is pair.kept:
                pair.kept_version = pair.kept._version

    def drop_kept(self) -> None:
        """Drop each kept float16 gradient the parameter still holds (a new backward's is not touched)."""
        if not self.kept_any:
            return
        self.kept_any = False
        for pair in self.pairs:
            if pair.kept is not None and pair.low.grad is pair.kept:
                pair.low.grad = None
            pair.kept = None


def _seen(pairs: list[Pair], lows: list[torch.Tensor], before: list[int | None]) -> None:
    """``Pair.seen`` of plain ``pairs`` (``lows`` their parameters) just written whole by a multi-tensor copy:
    each is its master rounded (``exact``). Where the copy found each parameter in the storage of its last
    ``seen`` (``before``: the storages when the copy began; a copy neither moves nor retypes a storage), that
    storage is held already (``seen`` notes a storage only with it held): only the version counters and
    dtypes are noted."""
    if before != list(map(_SEEN_STORAGE, pairs)):
        for pair in pairs:
            pair.exact = True
            pair.seen()
        return
    for pair, version, dtype in zip(pairs, map(_VERSION, lows), map(grads.DTYPE, lows), strict=True):
        pair.exact, pair.low_version, pair.low_dtype = True, version, dtype
