"""float32 masters and float32 gradient sums for an optimizer that no scaler steps: a bfloat16 model in any
framework's own bfloat16 mode (none builds a scaler there), or any loop without one
(``gradscaler.with_master_weights(optimizer)``).

The anchors keep master weights in an optimizer wrapper (Megatron-LM's ``Float16OptimizerWithFloat16Params``,
DeepSpeed's ``BF16_Optimizer``) that a framework steps as its optimizer. Here the optimizer stays the user's
own object, so every framework takes it as it is (``isinstance``, LR schedulers, Accelerate's and Lightning's
wrappers, ``state_dict``): its ``param_groups`` get the masters at once, before the first backward (so the
first iteration is no special state), and torch's own step hooks do the rest:

* **Gradients.** Each float16/bfloat16 parameter's post-accumulate-grad hook adds every backward's gradient
  into its master's ``.grad`` in float32 and leaves ``p.grad`` None (``accumulate``). The masters' gradients
  behave as the parameters' own would: they add up across backwards until ``optimizer.zero_grad()`` or
  ``model.zero_grad()`` clears them (the HF Trainer calls the latter: ``torch.nn.Module.zero_grad`` is wrapped,
  while an optimizer has masters from the line, to clear the sums of the module's parameters, ``zeroing``).
  That is where a reader finds them: the ``.grad`` of the parameters the optimizer holds.
* **Clipping.** ``torch.nn.utils.clip_grad_norm_``/``clip_grad_value_`` over ``model.parameters()`` clip the
  masters' sums (``wrappers.route``: Accelerate's, the HF Trainer's and nanoGPT's call); over the optimizer's
  parameters (Lightning's ``gradient_clip_val``) they are the masters already.
* **Values.** Every float16/bfloat16 parameter in the groups gets a master and a hook, a frozen one too (no
  ``scale()`` comes to hook it once unfrozen: gradual unfreezing sums in float32 from its first backward), and
  so does each of a group ``add_param_group`` adds, at once. A step pre-hook refreshes a master whose parameter
  was written since the last step (a model load); a step post-hook copies each master with a gradient into
  its parameter (a frozen parameter written in place inside the step's closure keeps the write).
* **Checkpoints.** The optimizer's ``state_dict`` carries the masters and their float32 state, as with a
  scaler's masters (``checkpoint``); a model saved alone is a plain bfloat16 model.

The recipe by hand it equals, bit for bit: after each backward ``m.grad = p.grad.float()`` (or ``m.grad +=
p.grad.float()`` once ``m.grad`` exists) and ``p.grad = None``; the client's clipping over the ``m.grad``; the
optimizer over the masters; ``p.copy_(m)`` after each step. A scaler without ``master_weights`` over such an
optimizer (torch's too) is the recipe's scaler over the optimizer of copies; one with ``master_weights=True``
is refused (``checks.HELD_MESSAGE``).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from gradscaler.errors import warn
from gradscaler.masters import zeroing
from gradscaler.masters.checks import HELD_ATTR
from gradscaler.masters.lifecycle import MasterWeights
from gradscaler.masters.pairs import Binding
from gradscaler.masters.wrappers import ZeroGradBoth, unwrap

NOTHING_MESSAGE = (
    "Call gradscaler.with_master_weights(optimizer) after the model is cast to bfloat16/float16 (after "
    "model.to(torch.bfloat16), Fabric's setup(model), or inside fabric.init_module()), or leave it out for a "
    "float32 model under torch.autocast (its gradients are float32 already). {name} holds no float16/bfloat16 "
    "parameter that requires a gradient, so it got no masters yet; one that appears later is bound at the "
    "next step, and its gradients of the iteration before were summed in its own dtype."
)

NOT_AN_OPTIMIZER_MESSAGE = (
    "Pass the torch.optim.Optimizer that steps the model (gradscaler.with_master_weights(torch.optim.AdamW("
    "model.parameters()))); got {kind}."
)

RE_EVALUATING_MESSAGE = (
    "Use an optimizer that evaluates its closure once per step, or keep the model in float32 for {name}. "
    "{name} evaluates its closure at new points inside one step, and with_master_weights writes the masters "
    "into the bfloat16 parameters only after the step, so each evaluation would see the old weights."
)

SCALERS_MASTERS_MESSAGE = (
    "Leave out either gradscaler.with_master_weights(optimizer) or the scaler's master_weights=True: this "
    "optimizer already steps a GradScaler(master_weights=True)'s float32 masters. Nothing was changed."
)

DISTRIBUTED_MESSAGE = (
    "Use the scaler's route with several processes: scaler = gradscaler.GradScaler.for_bf16(device, "
    "master_weights=True, accumulate_grads_in_fp32=True) over a plain optimizer, and under DDP "
    "scaler.register_ddp(ddp_model) (docs/bfloat16.md, Limits). with_master_weights sums each backward into "
    "the masters on this process only and averages nothing across the {world} ranks of the default process "
    "group. Nothing was changed."
)


class Held:
    """The masters of one optimizer that no scaler steps, and the step hooks that keep them."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.masters = MasterWeights(accumulate=True)
        self.count = -1  # pairs when last noted for ``model.zero_grad()``
        binding = self.hold(optimizer)
        setattr(optimizer, HELD_ATTR, self)
        # torch's own hooks, run inside every step, whoever calls it; the load hook runs after the masters'
        # own (which closes the clipping route) and routes again
        self.handles = [
            optimizer.register_step_pre_hook(self.before),
            optimizer.register_step_post_hook(self.after),
            optimizer.register_load_state_dict_post_hook(self.loaded),
        ]
        self.ref = weakref.ref(optimizer)
        self.checked = optimizer.add_param_group  # the masters' own (``wrappers.AddParamGroupChecked``)
        optimizer.add_param_group = self.add_param_group  # type: ignore[method-assign]
        if not binding.pairs:
            warn(NOTHING_MESSAGE.format(name=type(optimizer).__name__), UserWarning)

    def hold(self, optimizer: torch.optim.Optimizer, refresh: bool = True) -> Binding:
        binding = self.masters.hold(optimizer, refresh)
        if len(binding.pairs) != self.count:
            zeroing.held((pair.low, pair.master) for pair in binding.pairs)  # model.zero_grad() clears them
            self.count = len(binding.pairs)
        return binding

    def before(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self.hold(optimizer)

    def after(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self.masters.copy_back(optimizer)
        self.masters.watch(None)  # parameters unfrozen since: hooked before the next backward

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """The optimizer's ``add_param_group``, its new parameters bound at once: their next backward sums
        into their masters, and a clipping before the next step reaches them."""
        self.checked(param_group)
        optimizer = self.ref()
        if optimizer is not None:
            self.hold(optimizer)

    def loaded(self, optimizer: torch.optim.Optimizer) -> None:
        self.hold(optimizer, refresh=False)  # a loaded master waits for the model's load, if it comes


def with_master_weights(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """Give ``optimizer``'s float16/bfloat16 parameters float32 masters and float32 gradient sums, for a loop
    that builds no scaler (a framework's bfloat16 mode); returns the same optimizer, bound now.

    One line in each client: the optimizer handed to the Trainer, Accelerate's ``prepare``, Lightning's
    ``configure_optimizers`` or Fabric's ``setup``; ``GradScaler(master_weights=True)`` is the same
    mechanism for a float16 loop that scales its loss. Calling it again on the same optimizer binds what
    is new (a model cast to bfloat16 since the first call). Refused: an optimizer that evaluates its
    closure at new points inside a step (LBFGS), one a scaler's masters are bound to, and several
    processes (the scaler's route averages the sums across ranks). docs/bfloat16.md shows each client's
    line."""
    inner = unwrap(optimizer)
    if not isinstance(inner, torch.optim.Optimizer):
        raise TypeError(NOT_AN_OPTIMIZER_MESSAGE.format(kind=type(optimizer).__name__))
    held = vars(inner).get(HELD_ATTR)
    if held is not None:
        held.hold(inner)
        return optimizer
    if isinstance(inner, torch.optim.LBFGS):
        raise TypeError(RE_EVALUATING_MESSAGE.format(name=type(inner).__name__))
    if isinstance(vars(inner).get("zero_grad"), ZeroGradBoth):  # a scaler's live binding (a copy has none)
        raise ValueError(SCALERS_MASTERS_MESSAGE)
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        world = torch.distributed.get_world_size()
        if world > 1:
            raise ValueError(DISTRIBUTED_MESSAGE.format(world=world))
    Held(inner)
    return optimizer
