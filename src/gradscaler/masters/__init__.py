"""float32 master weights for float16 and bfloat16 parameters (``GradScaler(..., master_weights=True)``).

The package, lowest first; a file imports only files above it in this list (tests/test_layers.py):

- ``checks``: which parameters get a master (``needs_master``, ``trained``, ``stands_in``) and every
  refusal with its message (meta or sparse parameters, one held twice or by two optimizers, an inner
  optimizer, a gradient written after the move, a disabled scaler, the float32 sums' refusals and warnings).
- ``ddp``: ``scaler.register_ddp(ddp_model)``: the parameters DDP reduces and its process group; at the
  move, DDP's reduced low-precision gradient dropped and the float32 sums averaged across the group.
- ``checkpoint``: the optimizer's state-dict hooks and which saved master or state a binding or a load
  takes (``claims``, ``master_of``, ``state_for_master``, ``continues`` and its ``ContinuedWarning``);
  the refusal of torch's distributed-checkpoint helpers.
- ``graph``: the float16/bfloat16 parameters a scaled loss's graph reaches, those a reentrant activation
  checkpoint hides included (hooked by the float32 sums before any optimizer is bound).
- ``moved``: ``Moved``, what one move of gradients into the masters found (flags, norms, the masters'
  gradients), and which gradients its one pass takes.
- ``zeroing``: torch's ``Optimizer.zero_grad`` and ``Module.zero_grad`` reaching the float32 sums kept
  outside ``p.grad`` (in a hook before the binding; in the masters of ``with_master_weights``).
- ``pairs``: ``Pair`` (one low-precision parameter and its master) and ``Binding`` (an optimizer's pairs).
- ``sums``: ``Sum``, one parameter's float32 sum and the post-accumulate-grad hook that keeps it, which
  belongs to the scaler whose optimizer steps the parameter (``give_way``).
- ``wrappers``: what reaches the masters through the user's objects: ``unwrap`` of Accelerate's and
  Lightning's wrappers, ``clip_grad_norm_`` routed through the masters, ``zero_grad`` and
  ``add_param_group`` of a bound optimizer.
- ``accumulate``: ``accumulate_grads_in_fp32=True``, each backward's gradient of a low-precision
  parameter added into a float32 sum by a post-accumulate-grad hook (``Accumulation``), the master's
  gradient once bound.
- ``lifecycle``: ``MasterWeights``, which the scaler owns and calls at the iteration's fixed points
  (bind, move, copy back), and ``NoMasters`` for a scaler without masters.
- ``standalone``: ``with_master_weights(optimizer)``, the masters and float32 sums of an optimizer no scaler
  steps (a framework's bfloat16 mode), kept by torch's own step hooks on the user's optimizer.

Public here: ``clip_grad_norm_`` and ``clip_grad_value_`` (torch's functions, routed to the masters'
gradients) and
``ContinuedWarning``; the scaler and ``drop_in`` use the other names below (``build``: the service a
scaler's ``master_weights`` and ``accumulate_grads_in_fp32`` ask for).
"""

from gradscaler.masters.checkpoint import SAVED_KEY, ContinuedWarning
from gradscaler.masters.checks import LOW_PRECISION, WITHOUT_MASTERS_MESSAGE
from gradscaler.masters.lifecycle import MasterWeights, Moved, NoMasters
from gradscaler.masters.standalone import with_master_weights
from gradscaler.masters.wrappers import (
    ROUTED_CLIPPING,
    clip_grad_norm_,
    clip_grad_value_,
    torch_clip_grad_norm_,
    torch_clip_grad_value_,
    unwrap,
)

__all__ = [
    "DEFAULTS",
    "LOW_PRECISION",
    "ROUTED_CLIPPING",
    "SAVED_KEY",
    "WITHOUT_MASTERS_MESSAGE",
    "ContinuedWarning",
    "MasterWeights",
    "Moved",
    "NoMasters",
    "build",
    "clip_grad_norm_",
    "clip_grad_value_",
    "torch_clip_grad_norm_",
    "torch_clip_grad_value_",
    "unwrap",
    "with_master_weights",
]


DEFAULTS = [False, False]
"""``master_weights`` and ``accumulate_grads_in_fp32`` for a scaler built without them: an active
``patch_torch(...)``'s (it sets them; ``unpatch_torch`` puts False back), so that every scaler built under
the patch, by any name, takes its arguments."""


def build(master_weights: bool | None, accumulate_grads_in_fp32: bool | None) -> MasterWeights | NoMasters:
    """The masters of a scaler built with these two arguments (None: ``DEFAULTS``; the float32 sums only
    with masters); ``ValueError`` for accumulation without masters (nothing built)."""
    if master_weights is None:
        master_weights = DEFAULTS[0]
    if accumulate_grads_in_fp32 is None:
        accumulate_grads_in_fp32 = DEFAULTS[1] and master_weights
    if accumulate_grads_in_fp32 and not master_weights:
        raise ValueError(WITHOUT_MASTERS_MESSAGE)
    return MasterWeights(accumulate_grads_in_fp32) if master_weights else NoMasters()
