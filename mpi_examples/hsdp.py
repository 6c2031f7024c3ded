"""HSDP (FSDP2 sharded inside a node, replicated across nodes) with DynamiQ's
compressed all-reduce across the replicas, under torchrun:

    torchrun --nproc_per_node 4 mpi_examples/hsdp.py           # GPUs (nccl), or CPU (gloo)
    torchrun --nnodes 2 --nproc_per_node 8 ... mpi_examples/hsdp.py --shard 8

The mesh is (replicas, shard); each decoder layer of a (tiny) LLaMA and then
the whole model are sharded over the shard dimension with BF16 parameters.
FSDP2 reduce-scatters inside a replica uncompressed (the fast link); its
all-reduce across replicas (the slow link) goes through ``dqt.HSDP``.
"""
import argparse
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from transformers import LlamaConfig, LlamaForCausalLM

import dynamiq_mpi as dq
import dynamiq_mpi.torch as dqt


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--shard", type=int, default=2, help="ranks a replica is sharded over "
                   "(the GPUs of a node); the world size must be a multiple of it")
    args = p.parse_args(argv)
    cuda = torch.cuda.is_available()
    if cuda:
        local = int(os.environ.get("LOCAL_RANK", 0))
        if local >= torch.cuda.device_count():
            raise SystemExit(f"hsdp.py: local rank {local} has no GPU of its own "
                             f"({torch.cuda.device_count()} visible): one rank a GPU")
        torch.cuda.set_device(local)
    dist.init_process_group("nccl" if cuda else "gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    if world % args.shard or world == args.shard:
        raise SystemExit(f"hsdp.py: {world} ranks do not make two or more replicas of "
                         f"{args.shard} shards")
    mesh = init_device_mesh("cuda" if cuda else "cpu", (world // args.shard, args.shard),
                            mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                         max_position_embeddings=64)
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    model = LlamaForCausalLM(config).to(device)
    hsdp = dqt.HSDP(mesh, codec=dq.DynamiQ(bits=5), reports=True)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mesh=hsdp.shard_mesh, mp_policy=policy)
    fully_shard(model, mesh=hsdp.shard_mesh, mp_policy=policy)
    hooks = hsdp.attach(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    gen = torch.Generator().manual_seed(1000 + rank)          # each rank its own data
    for step in range(args.steps):
        ids = torch.randint(0, config.vocab_size, (4, 32), generator=gen).to(device)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        stats = hsdp.pop_stats()
        if rank == 0:
            paths = ", ".join(f"{n} {p}" for p, n in stats["paths"].items())
            print(f"step {step}: loss {loss.item():.4f}, {stats['calls']} replica "
                  f"all-reduce(s) ({paths})")
    # each shard must be the same on every replica: compare with the replicas' maximum
    shard = torch.cat([q.to_local().detach().float().flatten() for q in model.parameters()])
    top = shard.clone()
    dist.all_reduce(top, op=dist.ReduceOp.MAX, group=mesh.get_group("replicate"))
    same = torch.tensor([float(torch.equal(top, shard))], device=device)
    dist.all_reduce(same, op=dist.ReduceOp.MIN)
    if rank == 0:
        print(f"HSDP, {world // args.shard} replicas x {args.shard} shards over the "
              f"{hsdp.collective.control_plane} control plane, {hooks} FSDP modules hooked; "
              f"shards identical across replicas: {bool(same.item())}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
