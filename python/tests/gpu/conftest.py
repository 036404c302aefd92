"""GPU tests of the bridge: PyTorch FSDP2 at W = 1 on one GPU."""

import os

import pytest

from gpu_support import torch


@pytest.fixture(scope="session", autouse=True)
def process_group():
    import torch.distributed as dist

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29531")
        dist.init_process_group("nccl", rank=0, world_size=1)
    torch.cuda.set_device(0)
    yield


