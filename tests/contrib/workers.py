"""Rank programs for the contrib tests (one process per rank, torchrun's environment variables)."""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist


def _init(backend: str) -> tuple[int, int, torch.device]:
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    return rank, world, device


def _split(total: int, world: int, uneven: bool) -> list[int]:
    if not uneven:
        return [total // world] * world
    sizes = [1 + 2 * r for r in range(world)]  # 1, 3, 5, ...
    sizes[-1] += total - sum(sizes)
    return sizes


def sync_bn(backend: str, uneven: bool) -> None:
    from bagua_lightning.engine.contrib.sync_batchnorm import SyncBatchNorm

    rank, world, device = _init(backend)
    if world == 1:  # one GPU: still take the collective path (a one-rank gather and all-reduce)
        SyncBatchNorm._world_size = lambda self: 2  # type: ignore[method-assign]
    torch.manual_seed(0)
    total, c = 16 * world, 3
    x_all = (torch.randn(total, c, 4, 5) * 3 + 2).to(device)
    w_out = torch.randn_like(x_all)
    sizes = _split(total, world, uneven)
    lo = sum(sizes[:rank])
    x = x_all[lo : lo + sizes[rank]].clone().requires_grad_(True)

    ref = torch.nn.BatchNorm2d(c).to(device)
    with torch.no_grad():
        ref.weight.uniform_(0.5, 1.5)
        ref.bias.uniform_(-0.5, 0.5)
    bn = SyncBatchNorm.convert_sync_batchnorm(torch.nn.Sequential(torch.nn.BatchNorm2d(c))).to(device)
    bn[0].load_state_dict(ref.state_dict())
    assert isinstance(bn[0], SyncBatchNorm)

    for _ in range(2):  # two steps: running statistics accumulate
        x.grad = None
        bn.zero_grad()
        ref.zero_grad()
        xr = x_all.clone().requires_grad_(True)
        y_ref = ref(xr)
        (y_ref * w_out).sum().backward()
        y = bn(x)
        (y * w_out[lo : lo + sizes[rank]]).sum().backward()
        torch.testing.assert_close(y, y_ref[lo : lo + sizes[rank]], rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(x.grad, xr.grad[lo : lo + sizes[rank]], rtol=1e-4, atol=1e-5)
        gw, gb = bn[0].weight.grad.clone(), bn[0].bias.grad.clone()
        dist.all_reduce(gw)
        dist.all_reduce(gb)
        torch.testing.assert_close(gw, ref.weight.grad, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(gb, ref.bias.grad, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(bn[0].running_mean, ref.running_mean, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(bn[0].running_var, ref.running_var, rtol=1e-5, atol=1e-6)
    bn.eval()
    ref.eval()
    torch.testing.assert_close(bn(x.detach()), ref(x.detach()), rtol=1e-5, atol=1e-6)
    print(f"rank {rank}: sync_bn ok ({backend}, sizes {sizes})", flush=True)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("what")
    parser.add_argument("--backend", default="gloo")
    parser.add_argument("--uneven", action="store_true")
    parser.add_argument("--k", type=int, default=1)
    args = parser.parse_args()
    if args.what == "sync_bn":
        sync_bn(args.backend, args.uneven)
    elif args.what == "moe":
        from tests.contrib.moe_workers import moe

        moe(args.backend, args.k)
    else:
        raise SystemExit(f"unknown worker {args.what!r}")


if __name__ == "__main__":
    main()
