"""FSDP2 as LLM jobs run it, BF16 parameters and float32 gradient reduction,
with DynamiQ's compressed reduce-scatter, under torchrun:

    torchrun --nproc_per_node 2 mpi_examples/fsdp2_bf16.py        # GPUs (nccl), or CPU (gloo)

Each decoder layer of a (tiny) LLaMA and then the whole model are sharded
with ``MixedPrecisionPolicy(param_dtype=torch.bfloat16,
reduce_dtype=torch.float32)``: forward and backward run in BF16, FSDP hands
the float32 gradients to ``dqt.ReduceScatter``, which compresses them on the
wire (DynamiQ at 5 bits).  Parameters are all-gathered by FSDP, uncompressed.
"""
import argparse
import os

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from transformers import LlamaConfig, LlamaForCausalLM

import dynamiq_mpi as dq
import dynamiq_mpi.torch as dqt


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=5)
    args = p.parse_args(argv)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else None
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                         max_position_embeddings=64)
    model = LlamaForCausalLM(config).to(device or "cpu")
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    rs = dqt.ReduceScatter(codec=dq.DynamiQ(bits=5), reports=True)
    for module in model.modules():          # every FSDP module has its own parameter group
        if hasattr(module, "set_custom_reduce_scatter"):
            module.set_custom_reduce_scatter(rs)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    gen = torch.Generator().manual_seed(1000 + rank)          # each rank its own data
    for step in range(args.steps):
        ids = torch.randint(0, config.vocab_size, (4, 32), generator=gen).to(device or "cpu")
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        stats = rs.pop_stats()
        if rank == 0:
            paths = ", ".join(f"{n} {p}" for p, n in stats["paths"].items())
            bits = stats["bits_per_coord"]
            print(f"step {step}: loss {loss.item():.4f} ({loss.dtype}), {stats['calls']} "
                  f"reduce-scatter(s) ({paths}), "
                  f"{'n/a' if bits is None else f'{bits:.2f}'} bits/coordinate")
    dtypes = {str(q.dtype) for q in model.parameters()}
    if rank == 0:
        print(f"FSDP2 with BF16 parameters over the {rs.collective.control_plane} control "
              f"plane, {dist.get_world_size()} ranks; sharded parameters kept in {dtypes}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
