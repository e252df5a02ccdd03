"""Loaded by every Python process of a vLLM test run (engine and workers) through PYTHONPATH: when
CKPTCONV_VLLM_DUMP names a directory, it records what the test compares against, without changing
what vLLM does:
- the keys, shapes and dtypes vLLM's pre-sharded loader requires on each rank (its state dict when
  `ShardedStateLoader.load_weights` starts);
- the weights a normal load puts in each parameter, taken just before the CPU backend repacks them
  for its kernels (linear weights and biases, fused-MoE weights) and dumped by `dump_state`.
"""
import importlib.abc
import importlib.machinery
import json
import os
import sys

DUMP = os.environ.get("CKPTCONV_VLLM_DUMP")


def _rank():
    import torch.distributed as dist
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _sharded_loader(module):
    cls = module.ShardedStateLoader
    real = cls.load_weights

    def load_weights(self, model, model_config):
        sd = cls._filter_subtensors(model.state_dict())
        with open(os.path.join(DUMP, f"keys-rank{_rank()}.json"), "w") as f:
            json.dump({k: [list(v.shape), str(v.dtype).replace("torch.", "")] for k, v in sd.items()}, f)
        return real(self, model, model_config)

    cls.load_weights = load_weights


def _linear(module):
    real = module.dispatch_cpu_unquantized_gemm

    def dispatch(layer, remove_weight):
        layer._ckpt_weight = layer.weight.detach().clone()
        if getattr(layer, "bias", None) is not None:
            layer._ckpt_bias = layer.bias.detach().clone()
        return real(layer, remove_weight)

    module.dispatch_cpu_unquantized_gemm = dispatch


def _moe(module):
    cls = module.UnquantizedFusedMoEMethod
    real = cls.process_weights_after_loading

    def process(self, layer):
        layer._ckpt_w13, layer._ckpt_w2 = layer.w13_weight.detach().clone(), layer.w2_weight.detach().clone()
        return real(self, layer)

    cls.process_weights_after_loading = process


PATCHES = {"vllm.model_executor.model_loader.sharded_state_loader": _sharded_loader,
           "vllm.model_executor.layers.utils": _linear,
           "vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method": _moe}


class _AfterImport(importlib.abc.MetaPathFinder):
    """Patch a module right after it is first executed."""

    def find_spec(self, name, path, target=None):
        if name not in PATCHES:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        real = spec.loader.exec_module

        def exec_module(module):
            real(module)
            PATCHES[name](module)

        spec.loader.exec_module = exec_module
        return spec


def dump_state(worker):
    """collective_rpc target: this rank's parameters as loaded (before repacking) to ref-rankR.safetensors."""
    from safetensors.torch import save_file
    model = worker.model_runner.model
    held = {k: v for k, v in model.state_dict().items() if v.numel()}
    for name, mod in model.named_modules():
        for attr, key in (("_ckpt_weight", "weight"), ("_ckpt_bias", "bias"), ("_ckpt_w13", "w13_weight"),
                          ("_ckpt_w2", "w2_weight")):
            if hasattr(mod, attr):
                held[f"{name}.{key}"] = getattr(mod, attr)
    save_file({k: v.contiguous() for k, v in held.items()}, os.path.join(DUMP, f"ref-rank{_rank()}.safetensors"))


if DUMP:
    sys.meta_path.insert(0, _AfterImport())
