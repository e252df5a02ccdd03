"""Stand-ins for the DeepSpeed classes in ZeRO checkpoint pickles, read as inert data by name.

Beside torch's tensors and storages, DeepSpeed 0.19 pickles four objects of its own into a ZeRO
checkpoint's files: the loss scaler (`LossScaler`, `DynamicLossScaler`: NEWOBJ, then BUILD with a
dict of numbers), the ZeRO stage (`ZeroStageEnum(2)`: an enum called with its value) and where each
parameter lies in a rank's partition (`fragment_address`, a dataclass: NEWOBJ, then BUILD). Nothing
is imported or called: the scaler and the addresses are inert records, and the stage is the integer
it names. Every other global of the file is looked up in torch's allowlist (torch_globals.py), and
one on neither list stops the run.
"""
from .torch_globals import torch_globals
from .unpickler import Function, InertClass

_STAGES = {0: "disabled", 1: "optimizer_states", 2: "gradients", 3: "weights"}   # ZeroStageEnum's members


def _zero_stage(ctx, value=None, *rest):
    """ZeroStageEnum(value): the member of that value, as its integer."""
    if rest or type(value) is not int or value not in _STAGES:
        raise ctx.bad(f"deepspeed.runtime.zero.config.ZeroStageEnum of {value!r:.40}: not a ZeRO stage (0-3)")
    return value


def deepspeed_globals() -> dict:
    """The allowlist for DeepSpeed ZeRO checkpoint files: torch's, plus DeepSpeed's own classes."""
    out = torch_globals()
    for module, name in [("deepspeed.runtime.fp16.loss_scaler", "LossScaler"),
                         ("deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler"),
                         ("deepspeed.utils.tensor_fragment", "fragment_address")]:
        out[(module, name)] = InertClass(f"{module}.{name}")
    out[("deepspeed.runtime.zero.config", "ZeroStageEnum")] = Function(
        "deepspeed.runtime.zero.config.ZeroStageEnum", _zero_stage)
    return out
