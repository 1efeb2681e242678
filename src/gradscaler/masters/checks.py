"""Which parameters get float32 masters, and what ``master_weights=True`` refuses, with the fix.

A float16/bfloat16 parameter that requires a gradient gets a master (``needs_master``); a float32 tensor
that names its parameter (``PARAM_ATTR``) is a copied optimizer's master waiting for its binding
(``stands_in``). Refused before anything changes, the parameter named by its place in the optimizer
(``describe``): a parameter on the meta device or with a sparse layout, one held twice, one held by
two optimizers of one scaler, an optimizer stepping through an inner optimizer of its own, a float16
gradient written after the move that the step would not see, and a disabled scaler asked to step
low-precision parameters. Plain functions of the optimizer; ``masters.MasterWeights`` calls them.
"""

from __future__ import annotations

from collections.abc import Container, Mapping
from typing import Any

import torch

LOW_PRECISION = (torch.float16, torch.bfloat16)
PARAM_ATTR = "_gradscaler_param"
"""The attribute of a master naming its model parameter; it travels with pickles and deep copies."""


def low_params(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The float16/bfloat16 tensors in ``optimizer``'s groups, in group order (the parameters it steps as
    masters are float32 there: these have none yet, or are frozen)."""
    return [
        param
        for group in optimizer.param_groups
        for param in group["params"]
        if isinstance(param, torch.Tensor) and param.dtype in LOW_PRECISION
    ]


WRITTEN_LOW_GRADS_MESSAGE = (
    "Call scaler.clip_grad_norm_(optimizer, max_norm), or apply the function to the optimizer's own "
    "parameters, [p for g in optimizer.param_groups for p in g['params']] (the masters, whose gradients "
    "are stepped). The float16/bfloat16 gradient of {name} was written after scaler.unscale_(optimizer) "
    "moved it to its float32 master, which is what the optimizer steps (a clipping over "
    "model.parameters() other than torch.nn.utils.clip_grad_norm_ and clip_grad_value_, such as adaptive "
    "clipping, or a function bound before the scaler's first step?): with master_weights=True that write "
    "would be lost."
)

INNER_OPTIMIZER_MESSAGE = (
    "Build the optimizer over float32 copies of the parameters by hand (docs/migration.md, 'float16 "
    "parameters: master weights'), keep the model in float32 under torch.autocast, or shard with FSDP2 "
    "(torch.distributed.fsdp.fully_shard), whose parameters get float32 masters. master_weights=True "
    "cannot train {kind}: it steps its parameters through an optimizer of its own (its attribute "
    "{attr!r}), which would keep stepping the float16/bfloat16 parameters while the float32 masters are "
    "never stepped."
)

DISABLED_MESSAGE = (
    "Enable the scaler (enabled=True) to train {name} with float32 master weights, give the optimizer "
    "masters without a scaler (gradscaler.with_master_weights(optimizer), for a bfloat16 model trained "
    "without loss scaling), or cast the model to float32 (model.float()). GradScaler(master_weights=True, "
    "enabled=False) does not scale and keeps no masters: step() calls optimizer.step() as it is, which "
    "would step the parameter in {dtype} and lose the updates below its resolution."
)


HELD_ATTR = "_gradscaler_held_by"
"""The attribute of an optimizer ``with_master_weights`` gave masters: its ``standalone.Held``, whose
``masters`` (a ``MasterWeights``) steer them."""

HELD_MESSAGE = (
    "Build the scaler without master_weights (GradScaler(master_weights=False), or torch's own scaler): "
    "this optimizer has float32 masters already (gradscaler.with_master_weights(optimizer)), whose float32 "
    "gradients any scaler unscales and checks as the recipe by hand's scaler does. A GradScaler with "
    "master_weights=True would bind them a second time; nothing was changed."
)


HELD_DDP_MESSAGE = (
    "Use the scaler's route under DDP: scaler = gradscaler.GradScaler.for_bf16(device, master_weights=True, "
    "accumulate_grads_in_fp32=True) over a plain optimizer, scaler.register_ddp(ddp_model) once, and "
    "scaler.scale(loss).backward(), scaler.step(optimizer), scaler.update() in the loop (docs/bfloat16.md, "
    "Limits). {name} holds a .grad written after its backward, DDP's reduced gradient: "
    "gradscaler.with_master_weights(optimizer) sums each backward into the masters before DDP reduces it "
    "and does not average the sums across ranks. Nothing was stepped."
)


def refuse_held(optimizer: torch.optim.Optimizer, masters: object) -> None:
    """``ValueError`` (``HELD_MESSAGE``) when ``with_master_weights`` gave ``optimizer`` masters that
    ``masters`` (a scaler's) are not."""
    held = vars(optimizer).get(HELD_ATTR)
    if held is not None and held.masters is not masters:
        raise ValueError(HELD_MESSAGE)


def describe(group: int, index: int, param: torch.Tensor) -> str:
    """How an error names a parameter: its place in the optimizer, shape and dtype."""
    return f"optimizer.param_groups[{group}]['params'][{index}] (shape {tuple(param.shape)}, {param.dtype})"


def needs_master(param: torch.Tensor, trained: bool = False) -> bool:
    """Whether the optimizer should step a float32 master instead of ``param``: a low-precision parameter
    that requires a gradient, or that ``trained`` (it has optimizer state or a saved master), frozen or
    not right now: a block frozen after it trained keeps its master's precision and float32 state."""
    return param.dtype in LOW_PRECISION and (param.requires_grad or trained)


def trained(param: torch.Tensor, state: Mapping[Any, Any]) -> bool:
    """Whether the optimizer stepped the frozen low-precision ``param``: it holds state for it other than
    what a constructor made before any step (torch's ``Adagrad`` fills ``sum`` for every parameter, frozen
    ones too, at ``step`` 0). One host read of ``step`` per such parameter; asked at a binding only (a
    frozen parameter cannot train, so only a load changes the answer, and a load binds afresh)."""
    if param.requires_grad or param.dtype not in LOW_PRECISION or param not in state:
        return False
    step = state[param].get("step")
    return not isinstance(step, (torch.Tensor, int, float)) or float(step) != 0


def stands_in(param: torch.Tensor, trained: bool = False) -> bool:
    """Whether ``param`` needs a master (``needs_master``), or is one (a copied optimizer's) that still
    needs its binding."""
    if param.dtype == torch.float32:
        return hasattr(param, PARAM_ATTR)
    return needs_master(param, trained)


def check_params(
    optimizer: torch.optim.Optimizer, bound: Container[int], owners: Mapping[int, Any], lows: Container[int]
) -> None:
    """Refuse, before changing anything, a parameter no master can be built for or one held twice.

    ``bound``: the ids of the masters bound already (checked when they were bound); ``owners``: the id of each
    low-precision parameter -> a weak reference to the optimizer whose master stands for it; ``lows``:
    the ids of the parameters ``optimizer``'s masters stand for (one of them back in its groups is held
    twice: once as itself, once as its master)."""
    seen: dict[int, str] = {}
    for group_index, group in enumerate(optimizer.param_groups):
        for index, param in enumerate(group["params"]):
            name = describe(group_index, index, param)
            if id(param) in seen or id(param) in lows:
                first = seen.get(id(param), "its float32 master")
                raise ValueError(
                    "List each parameter in one place of the optimizer: with master_weights=True a float32 "
                    f"master can stand for it only once, and the optimizer holds one parameter twice, as {first} "
                    f"and as {name}."
                )
            seen[id(param)] = name
            if not stands_in(param, trained(param, optimizer.state)) or id(param) in bound:
                continue
            if param.dtype != torch.float32:
                check_buildable(name, param)
            owner = owners.get(id(getattr(param, PARAM_ATTR, param)))
            if owner is not None and owner() is not None and owner() is not optimizer:
                raise ValueError(
                    f"Give each parameter to one optimizer: with master_weights=True, {name} already has a "
                    "float32 master in another optimizer stepped by this scaler."
                )


def check_buildable(name: str, param: torch.Tensor) -> None:
    """Refuse a parameter whose master cannot be built: on the meta device, or not strided."""
    if param.is_meta:
        raise ValueError(
            "Materialise the model (to_empty() + initialisation, or load its weights) before the first "
            f"scaler.step(optimizer). master_weights=True cannot build a float32 master for {name}: it is on the "
            "meta device and has no values."
        )
    if param.layout is not torch.strided:
        raise ValueError(
            "Keep sparse parameters in float32 (param.data = param.data.float()) or freeze them "
            f"(requires_grad_(False)). master_weights=True cannot build a float32 master for {name}: its layout "
            f"is {param.layout}."
        )


def check_inner_optimizers(optimizer: torch.optim.Optimizer) -> None:
    """Refuse an optimizer that steps its parameters through an inner optimizer of its own (torch's
    ``ZeroRedundancyOptimizer``): the masters would replace them only in the outer ``param_groups``."""
    for attr, value in vars(optimizer).items():
        if isinstance(value, torch.optim.Optimizer) and value.param_groups is not optimizer.param_groups:
            raise ValueError(INNER_OPTIMIZER_MESSAGE.format(kind=type(optimizer).__name__, attr=attr))


def refuse_disabled(optimizer: torch.optim.Optimizer) -> None:
    """For a disabled scaler asked for masters: ``ValueError`` if ``optimizer`` would step a
    low-precision parameter that has a gradient (float32 runs pass untouched)."""
    for group_index, group in enumerate(optimizer.param_groups):
        for index, param in enumerate(group["params"]):
            if param.dtype in LOW_PRECISION and param.grad is not None:
                raise ValueError(DISABLED_MESSAGE.format(name=describe(group_index, index, param), dtype=param.dtype))


# The refusals and warnings of accumulate_grads_in_fp32 (``accumulate``).

WITHOUT_MASTERS_MESSAGE = (
    "Pass master_weights=True too (float16/bfloat16 parameters), or leave accumulate_grads_in_fp32 out (a "
    "float32 model under torch.autocast accumulates its gradients in float32 already). "
    "GradScaler(accumulate_grads_in_fp32=True) needs master_weights=True: the float32 sums are the "
    "gradients of the float32 masters."
)

SPARSE_MESSAGE = (
    "Build the layer with sparse=False (nn.Embedding(..., sparse=False)), keep it in float32, or leave "
    "accumulate_grads_in_fp32 out. With accumulate_grads_in_fp32=True the gradient of a parameter of "
    "shape {shape} ({dtype}) is sparse ({layout}): its micro-batches cannot be summed into a dense "
    "float32 gradient. Nothing was added for this backward."
)

CREATE_GRAPH_MESSAGE = (
    "Take the penalty's gradient with torch.autograd.grad(..., create_graph=True) and call backward() "
    "without create_graph, or leave accumulate_grads_in_fp32 out. With accumulate_grads_in_fp32=True a "
    "backward with create_graph=True (a double backward such as a gradient penalty) reaches a parameter of "
    "shape {shape} ({dtype}) whose gradient is summed in float32, and the float32 sum would cut that "
    "gradient from its graph. Nothing was added for this backward."
)

WRITTEN_MESSAGE = (
    "Write into the master's gradient instead of p.grad (scaler.master_weights(optimizer) gives the "
    "(parameter, master) pairs), or leave accumulate_grads_in_fp32 out. {name} holds a .grad that "
    "autograd's accumulation did not leave there: with accumulate_grads_in_fp32=True each backward's "
    "gradient goes into the float32 sum (the master's .grad) and p.grad is set to None, so a gradient "
    "written into p.grad by hand, or after scaler.unscale_(optimizer), would be lost: the optimizer steps "
    "the master."
)

FSDP2_MESSAGE = (
    "Keep the parameters in float32 and let FSDP2 compute in bfloat16/float16, fully_shard(module, "
    "mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)), whose "
    "sharded float32 gradients accumulate in float32 across micro-batches; or leave "
    "accumulate_grads_in_fp32 out. accumulate_grads_in_fp32=True cannot apply under FSDP2 (fully_shard): "
    "FSDP2 reduce-scatters each backward's gradient itself, in its reduce_dtype, and keeps the sharded "
    "gradient; a float32 sum per micro-batch would take the gradient before FSDP2 sees it. The scaler's "
    "hooks are removed and no master was built."
)

DDP_MESSAGE = (
    "Call scaler.register_ddp(ddp_model) once, after wrapping the model in DistributedDataParallel: the "
    "scaler then averages the float32 sums across DDP's ranks itself. {name} holds a .grad that "
    "autograd's accumulation did not leave there, DDP's reduced gradient: with "
    "accumulate_grads_in_fp32=True each backward's gradient goes into the float32 sum (the master's "
    ".grad) and p.grad is set to None, so DDP's gradient in p.grad would be lost: the optimizer steps the "
    "master."
)

SWAPPED_MESSAGE = (
    "Turn torch's swap-tensors future on for the whole run "
    "(torch.__future__.set_swap_module_params_on_conversion(True) before training), not around the "
    "conversion only. With accumulate_grads_in_fp32=True, {name} was swapped (torch.utils.swap_tensors: a "
    "dtype or device change under that future, or of a tensor-subclass parameter) after the scaler hooked "
    "it, and the future was off at the next scaler.scale(loss), where the scaler hooks swapped parameters "
    "again: its micro-batches were summed by autograd in {dtype}. Nothing was stepped; the parameter is "
    "hooked again for the next backward."
)

LATER_HOOK_MESSAGE = (
    "Register the post-accumulate-grad hook of {name} before the scaler first meets the parameter (before "
    "the first scaler.scale(loss)), or use param.register_hook(fn), which sees each backward's gradient. "
    "That hook was registered after the scaler's own, which with accumulate_grads_in_fp32=True moves each "
    "backward's gradient into the float32 sum and sets p.grad = None: the hook saw p.grad None."
)


LATE_MESSAGE = (
    "accumulate_grads_in_fp32=True: {count} low-precision parameter(s) of optimizer {optimizer} met the "
    "scaler only at this step, after its first iteration (a model or optimizer new to a scaler that has "
    "trained already, or an optimizer first stepped later, such as a critic stepped every few iterations): "
    "this iteration's micro-batches were summed by autograd in float16/bfloat16, as without the argument; "
    "from the next iteration on they are summed in float32. For float32 from the start, give a new model a "
    "new scaler (scaler.state_dict() carries the scale over), or call scaler.step on every optimizer in the "
    "first iteration."
)

HIDDEN_MESSAGE = (
    "accumulate_grads_in_fp32=True: {count} low-precision parameter(s) of optimizer {optimizer} got "
    "gradients in the first iteration that the scaler did not find in the graphs of scaler.scale(loss), "
    "where it looks for the parameters to hook before the first step: their micro-batches were summed by "
    "autograd in float16/bfloat16, as without the argument; from the next iteration on they are summed in "
    "float32. A custom autograd Function that uses a parameter it does not take as an input hides it, so does "
    "a backward of a graph that did not come from scaler.scale (a pipeline stage's "
    "torch.autograd.backward(outputs, grads)), and so does a reentrant activation checkpoint "
    "(torch.utils.checkpoint with use_reentrant=True, the default when the argument is left out) whose "
    "function the scaler cannot see into (it looks into modules, their methods, functools.partial, closures "
    "and default arguments). Use torch.utils.checkpoint(..., use_reentrant=False), "
    "or pass the module itself as the checkpointed function."
)

BOUND_CLIPPING_MESSAGE = (
    "accumulate_grads_in_fp32=True: module {module} holds torch's own {function} as {name} (imported by name "
    "before the scaler's first step). The scaler routes torch.nn.utils.{function} to the masters, not that "
    "name: called over the model's parameters it finds p.grad None for every float16/bfloat16 parameter "
    "(their gradients are the masters' float32 sums) and clips nothing, silently. Call it through the module, "
    "torch.nn.utils.{function}(model.parameters(), ...), or use scaler.clip_grad_norm_(optimizer, max_norm)."
)
