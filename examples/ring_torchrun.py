"""Ring attention under torchrun: every rank holds a zigzag shard of one long sequence.

    torchrun --nproc-per-node 2 examples/ring_torchrun.py --check         # CPU: gloo
    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \
    torchrun --nproc-per-node 2 examples/ring_torchrun.py --seqlen 65536  # GPUs: NCCL

Each rank builds the same random sequence (a real model has its own shard of the
activations), keeps its zigzag shard, and calls ``attnhub.attention`` with a ``BindContext``
whose ``world_size`` says that the sequence is sharded over the group. The policy binds
``ring`` there and picks the local kernel for the blocks with its other rules; rank 0 prints
both levels of the decision. ``--check`` compares each shard's output and gradients with
single-device attention under the same loss (keep ``--seqlen`` small for it: every rank
computes the whole sequence).
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
from attnhub_ring import ZigzagLayout, zigzag_shard

import attnhub

#: Ring for any context-parallel group; the local kernel comes from the hardware rules
#: (resolved at world size 1). Pass --policy to use a deployment's file instead.
POLICY = """\
name: ring-example
version: 1
description: ring attention across the context-parallel group, best local kernel inside
targets: [cpu, sm80, sm90]
rules:
  - name: context-parallel
    when: {world_size: {ge: 2}, phase: [train, prefill]}
    use: [ring]
  - name: hopper
    when: {hardware: sm90}
    use: [fa3, cudnn, fa2, torch_sdpa]
  - name: ampere
    when: {hardware: sm80}
    use: [fa2, fa2_torch, torch_sdpa]
  - name: anything-else  # inside ring SDPA is refused (its LSE is a second pass)
    use: [torch_sdpa, torch_flash_cpu, triton]
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqlen", type=int, default=4099, help="global tokens (any length)")
    ap.add_argument("--heads", type=int, nargs=2, default=(32, 8), metavar=("Q", "KV"))
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--policy", default=None, help="policy YAML (default: the one above)")
    ap.add_argument("--check", action="store_true", help="compare with one device")
    args = ap.parse_args()

    cuda = torch.cuda.is_available()
    if cuda:  # NCCL binds each rank to its GPU up front (device_id): no guessing, no hang
        local_rank = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(local_rank)
        dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
    else:
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda" if cuda else "cpu")
    dtype = torch.bfloat16 if cuda else torch.float32

    torch.manual_seed(0)  # the same sequence on every rank
    hq, hkv = args.heads
    q, k, v, grad = (torch.randn(1, args.seqlen, h, args.head_dim, device=device, dtype=dtype)
                     for h in (hq, hkv, hkv, hq))
    q_l, k_l, v_l = (zigzag_shard(x, rank, world).requires_grad_() for x in (q, k, v))
    # global positions of this rank's tokens, e.g. for RoPE before attention
    positions = ZigzagLayout(world, (args.seqlen,)).global_indices(rank)

    with tempfile.TemporaryDirectory() as tmp:
        policy = args.policy or Path(tmp) / "ring-example.yaml"
        if args.policy is None:
            Path(policy).write_text(POLICY)
        hub = attnhub.Hub(policy)
        ctx = attnhub.BindContext(model="example", world_size=world)
        out = hub.attention(q_l, k_l, v_l, causal=True, context=ctx)
    # the loss of the whole sequence is the sum of every rank's share: gradients flow back
    # around the ring
    (out * zigzag_shard(grad, rank, world)).sum().backward()

    if rank == 0:
        print(hub.bound()[0].decision.explain())
    print(f"rank {rank}: {q_l.shape[1]} of {args.seqlen} tokens (positions "
          f"{positions[:3].tolist()}...), out {tuple(out.shape)}, "
          f"|dq| {q_l.grad.float().norm():.3e}", flush=True)
    if args.check:  # the whole sequence on this device, same loss: compare this rank's shard
        full = [x.detach().clone().requires_grad_() for x in (q, k, v)]
        ref = attnhub.attention(*full, causal=True, backend="torch_sdpa")
        (ref * grad).sum().backward()
        errs = [(a.float() - zigzag_shard(b, rank, world).float()).abs().max().item()
                for a, b in ((out, ref), (q_l.grad, full[0].grad), (k_l.grad, full[1].grad),
                             (v_l.grad, full[2].grad))]
        print(f"rank {rank}: max |ring - one device| out {errs[0]:.2e} dq {errs[1]:.2e} "
              f"dk {errs[2]:.2e} dv {errs[3]:.2e}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
