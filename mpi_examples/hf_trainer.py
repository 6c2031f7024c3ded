"""Hugging Face Transformers' ``Trainer`` with the DynamiQ DDP hook, under torchrun:

    torchrun --nproc_per_node 2 mpi_examples/hf_trainer.py       # GPUs (nccl), or CPU (gloo)

``Trainer`` wraps the model in DDP itself, when training starts.  The hook is
therefore registered from a callback at ``on_train_begin``, on
``trainer.model_wrapped`` (the DDP model); the ``model`` a callback is handed
is the unwrapped one, on which a hook cannot be registered.  The model here
is a tiny LLaMA trained on random tokens, so that the script runs anywhere.
"""
import argparse

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from transformers import (LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback,
                          TrainingArguments)

import dynamiq_mpi as dq
import dynamiq_mpi.torch as dqt


class DynamiQHook(TrainerCallback):
    """Registers the hook on the trainer's DDP model when training begins,
    and keeps each step's hook statistics (``steps``)."""

    def __init__(self, trainer: Trainer, state: dqt.HookState):
        self.trainer, self.state, self.steps = trainer, state, []

    def on_train_begin(self, args, state, control, **kwargs):
        ddp = self.trainer.model_wrapped
        if not isinstance(ddp, DistributedDataParallel):
            raise RuntimeError(f"Trainer did not wrap the model in DDP (got "
                               f"{type(ddp).__name__}): launch with torchrun and several "
                               "processes")
        dqt.register_comm_hook(ddp, self.state)

    def on_step_end(self, args, state, control, **kwargs):
        self.steps.append(self.state.pop_stats())


class RandomTokens(torch.utils.data.Dataset):
    def __init__(self, n, seq_len, vocab, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, vocab, (n, seq_len), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--out", default="hf_trainer_out", help="Trainer's output_dir")
    args = p.parse_args(argv)
    cuda = torch.cuda.is_available()
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
                         max_position_embeddings=64)
    model = LlamaForCausalLM(config)
    training = TrainingArguments(output_dir=args.out, max_steps=args.steps,
                                 per_device_train_batch_size=4, learning_rate=1e-3,
                                 logging_steps=1, save_strategy="no", report_to=[],
                                 disable_tqdm=True, use_cpu=not cuda,
                                 ddp_backend="nccl" if cuda else "gloo",
                                 ddp_find_unused_parameters=False)
    trainer = Trainer(model=model, args=training,
                      train_dataset=RandomTokens(256, 32, config.vocab_size))
    hook = DynamiQHook(trainer, dqt.HookState(codec=dq.DynamiQ(bits=5)))
    trainer.add_callback(hook)
    trainer.train()

    flat = torch.cat([q.detach().reshape(-1).cpu() for q in model.parameters()])
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, flat)
    if dist.get_rank() == 0:
        buckets = sum(s["buckets"] for s in hook.steps)
        paths = {}
        for s in hook.steps:
            for path, n in s["paths"].items():
                paths[path] = paths.get(path, 0) + n
        losses = [round(h["loss"], 4) for h in trainer.state.log_history if "loss" in h]
        print(f"Trainer, {dist.get_world_size()} ranks over the "
              f"{hook.state.collective.control_plane} control plane: {len(hook.steps)} steps, "
              f"{buckets} buckets through the DynamiQ hook ({paths}), losses {losses}")
        print(f"parameters identical on every rank: "
              f"{all(torch.equal(e, everyone[0]) for e in everyone)}")


if __name__ == "__main__":
    main()
