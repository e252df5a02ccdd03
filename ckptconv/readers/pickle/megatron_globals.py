"""Stand-ins for the Megatron classes in Megatron checkpoint pickles, read as inert data by name.

Beside torch's tensors, dtypes and `argparse.Namespace` (the training arguments, a record already),
Megatron-LM pickles enum members into `args`: the model type (`ModelType.encoder_or_decoder`) and
the attention backend (`AttnBackend.auto`), each as its class called with its value. Nothing is
imported or called: a member is a record of its class and value. Every other global of the file is
looked up in torch's allowlist (torch_globals.py); one on neither list becomes a placeholder, which
stops the run only if it is in what the run keeps (the weights, or `args`, which go to the extras).
"""
from .torch_globals import torch_globals
from .unpickler import InertClass

ENUMS = [("megatron.core.enums", "ModelType"), ("megatron.core.transformer.enums", "ModelType"),
         ("megatron.core.transformer.enums", "AttnBackend")]


def megatron_globals() -> dict:
    """The allowlist for Megatron checkpoint files (legacy rank files, torch_dist's common.pt): torch's,
    plus Megatron's enums as records."""
    out = torch_globals()
    for module, name in ENUMS:
        out[(module, name)] = InertClass(f"{module}.{name}")
    return out
