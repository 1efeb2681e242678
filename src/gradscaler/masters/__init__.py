"""float32 master weights for float16 and bfloat16 parameters (``GradScaler(..., master_weights=True)``).

The package, lowest first; a file imports only files above it in this list (tests/test_layers.py):

- ``checks``: which parameters get a master (``needs_master``, ``trained``, ``stands_in``) and every
  refusal with its message (meta or sparse parameters, one held twice or by two optimizers, an inner
  optimizer, a gradient written after the move, a disabled scaler).
- ``checkpoint``: the optimizer's state-dict hooks and which saved master or state a binding or a load
  takes (``claims``, ``master_of``, ``state_for_master``, ``continues`` and its ``ContinuedWarning``);
  the refusal of torch's distributed-checkpoint helpers.
- ``pairs``: ``Pair`` (one low-precision parameter and its master) and ``Binding`` (an optimizer's pairs).
- ``wrappers``: what reaches the masters through the user's objects: ``unwrap`` of Accelerate's and
  Lightning's wrappers, ``clip_grad_norm_`` routed through the masters, ``zero_grad`` and
  ``add_param_group`` of a bound optimizer.
- ``lifecycle``: ``MasterWeights``, which the scaler owns and calls at the iteration's fixed points
  (bind, move, copy back), and ``NoMasters`` for a scaler without masters.

Public here: ``clip_grad_norm_`` (torch's function, routed to the masters' gradients) and
``ContinuedWarning``; the scaler and ``drop_in`` use the other names below.
"""

from gradscaler.masters.checkpoint import SAVED_KEY, ContinuedWarning
from gradscaler.masters.lifecycle import MasterWeights, Moved, NoMasters
from gradscaler.masters.wrappers import clip_grad_norm_, torch_clip_grad_norm_, unwrap

__all__ = [
    "SAVED_KEY",
    "ContinuedWarning",
    "MasterWeights",
    "Moved",
    "NoMasters",
    "clip_grad_norm_",
    "torch_clip_grad_norm_",
    "unwrap",
]
