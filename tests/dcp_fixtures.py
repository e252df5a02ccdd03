"""Make PyTorch Distributed Checkpoints with real torch: single process, 2 processes with gloo on
127.0.0.1 (DTensors sharded on dim 0 and 1, FSDP2 with optimizer state), the SAFETENSORS variant and
a zstd-transformed save; plus the reference each should equal (`dcp_to_torch_save`). Run as a script
(`python -m tests.dcp_fixtures OUT`) so torch.distributed lives in its own processes."""
import os
import shutil
import socket
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.multiprocessing as mp

warnings.filterwarnings("ignore")


def nested_state(contiguous=False):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.GELU(), torch.nn.Linear(5, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, 6)).sum().backward()
    opt.step()
    return {"model": model.state_dict(), "optim": opt.state_dict(), "step": 11,
            "extra": {"transposed": torch.arange(12.0).reshape(3, 4).t().contiguous() if contiguous
                      else torch.arange(12.0).reshape(3, 4).t(), "bf16": torch.randn(7).bfloat16()}}


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, world, port, out, kind):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Replicate, Shard, distribute_tensor
        mesh = init_device_mesh("cpu", (world,))
        torch.manual_seed(1)
        if kind == "dtensor":
            sd = {"rows": distribute_tensor(torch.randn(6, 4), mesh, [Shard(0)]),
                  "cols": distribute_tensor(torch.randn(3, 8), mesh, [Shard(1)]),
                  "uneven": distribute_tensor(torch.arange(35, dtype=torch.int32).reshape(5, 7), mesh, [Shard(0)]),
                  "rep": distribute_tensor(torch.randn(3), mesh, [Replicate()]),
                  "meta": {"epoch": 2}}
        else:
            from torch.distributed.checkpoint.state_dict import get_state_dict
            from torch.distributed.fsdp import fully_shard
            model = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.ReLU(), torch.nn.Linear(6, 5))
            for layer in (model[0], model[2]):
                fully_shard(layer, mesh=mesh)
            fully_shard(model, mesh=mesh)
            opt = torch.optim.Adam(model.parameters(), lr=1e-2)
            model(torch.randn(3, 8)).sum().backward()
            opt.step()
            msd, osd = get_state_dict(model, opt)
            sd = {"model": msd, "optim": osd}
        dcp.save(sd, checkpoint_id=out)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def reference(ckpt_dir, pt_path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    dcp_to_torch_save(ckpt_dir, pt_path)


def main(root):
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    dcp.save(nested_state(), checkpoint_id=root / "single")
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.filesystem import SerializationFormat
    dcp.save(nested_state(contiguous=True), storage_writer=FileSystemWriter(  # it refuses strided tensors
        root / "safetensors", serialization_format=SerializationFormat.SAFETENSORS))
    from torch.distributed.checkpoint._extension import ZStandard
    dcp.save(nested_state(), storage_writer=FileSystemWriter(root / "zstd", _extensions=[ZStandard()]))
    for kind in ("dtensor", "fsdp2"):
        for attempt in range(3):  # gloo sometimes aborts while tearing down; the save itself is retried whole
            shutil.rmtree(root / kind, ignore_errors=True)
            try:
                mp.spawn(_worker, args=(2, _free_port(), str(root / kind), kind), nprocs=2, join=True)
                break
            except mp.ProcessExitedException:
                if attempt == 2:
                    raise
    for name in ("single", "zstd", "dtensor", "fsdp2"):
        reference(root / name, root / f"{name}.pt")


if __name__ == "__main__":
    main(sys.argv[1])
