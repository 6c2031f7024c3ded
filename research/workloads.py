"""The workloads of the training simulator (train_sim.py) and of
mpi_examples/train_lm.py: a model, every rank's batch of a step, the loss,
and the evaluation.

* ``lm``: a byte-level LLaMA-style causal LM (``transformers`` built from a
  config), trained from scratch on the standard-library corpus (corpus.py);
  evaluation: validation loss in nats per byte.
* ``cls``: fine-tuning, closer to the paper's workloads: the same LM is
  first pretrained here on the corpus with exact gradients (``--pretrain-steps``,
  one process, cached under ``.cache/train_sim/``: every codec starts from
  the same weights), then fine-tuned with a classification head to tell
  which of eight standard-library packages a window of source comes from
  (the packages' bytes ship with every Python: nothing downloads);
  evaluation: validation loss and accuracy on the last tenth of every
  package's bytes.
"""
from __future__ import annotations

import hashlib
import math
import os
from pathlib import Path

# cls: the eight packages (directories of corpus.CORPUS_FILES) told apart
CLASSES = ("asyncio", "email", "http", "importlib", "json", "multiprocessing", "unittest",
           "urllib")


def lr_at(step, args):
    """Linear warm-up, then cosine decay to 10 % of the peak (the training
    example's and the simulator's schedule)."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    frac = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, frac))))


def build_model(args, device):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(args.seed)
    cfg = LlamaConfig(vocab_size=256, hidden_size=args.hidden, intermediate_size=args.intermediate,
                      num_hidden_layers=args.layers, num_attention_heads=args.heads,
                      num_key_value_heads=args.heads, max_position_embeddings=args.seq_len,
                      tie_word_embeddings=False, bos_token_id=None, eos_token_id=None,
                      pad_token_id=None)
    return LlamaForCausalLM(cfg).to(device)


def rank_batch(step, rank, n, data, args):
    """Rank ``rank``'s micro-batch of ``step``: a function of (seed, step, N,
    batch) only, so the same for every codec and in the real job."""
    import torch
    gen = torch.Generator().manual_seed(args.seed * 1_000_003 + step)
    starts = torch.randint(0, len(data) - args.seq_len - 1, (n * args.batch,), generator=gen)
    mine = starts[rank * args.batch:(rank + 1) * args.batch]
    return data[mine[:, None] + torch.arange(args.seq_len + 1)]


def _autocast(device):
    import torch
    return (torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda"
            else torch.autocast("cpu", enabled=False))


def lm_loss(model, w, device, reduction="mean"):
    import torch
    w = w.to(device)
    with _autocast(device):
        logits = model(input_ids=w[:, :-1].long()).logits
    return torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]),
                                             w[:, 1:].reshape(-1).long(), reduction=reduction)


class LMWorkload:
    name = "lm"

    def __init__(self, args, device):
        import torch

        from .corpus import load_corpus
        self.args, self.device = args, device
        train_b, val_b, self.info = load_corpus()
        self.train = torch.frombuffer(bytearray(train_b), dtype=torch.uint8)
        self.val = torch.frombuffer(bytearray(val_b), dtype=torch.uint8)
        self.model = build_model(args, device)

    def batch(self, step, rank, n):
        """Rank ``rank``'s micro-batch of ``step``, as a tuple of tensors."""
        return (rank_batch(step, rank, n, self.train, self.args),)

    def batch_loss(self, batch, call=None):
        """The loss of one rank's ``batch``; ``call`` stands for the model
        (torch.func's functional call in the batched mode)."""
        return lm_loss(self.model if call is None else call, batch[0], self.device)

    def loss(self, step, rank, n):
        return self.batch_loss(self.batch(step, rank, n))

    def evaluate(self) -> dict:
        """Mean validation loss (nats/byte) over the first ``val_windows``
        consecutive windows."""
        import torch
        args, model = self.args, self.model
        n = min(args.val_windows, (len(self.val) - 1) // args.seq_len)
        total, count = 0.0, 0
        model.eval()
        with torch.no_grad():
            for chunk in torch.arange(n).split(max(1, args.batch * 4)):
                idx = chunk[:, None] * args.seq_len + torch.arange(args.seq_len + 1)
                w = self.val[idx]
                total += float(lm_loss(model, w, self.device, reduction="sum"))
                count += w[:, 1:].numel()
        model.train()
        return {"val_loss": total / max(1, count)}


class _Classifier:
    """The LM's body, mean-pooled, and a linear head (a torch Module made
    on first use so that this file imports without torch)."""

    @staticmethod
    def make(lm, classes):
        from torch import nn

        class Classifier(nn.Module):
            def __init__(self):
                super().__init__()
                self.body = lm.model
                self.head = nn.Linear(lm.config.hidden_size, classes)

            def forward(self, ids):
                return self.head(self.body(input_ids=ids).last_hidden_state.mean(dim=1))
        return Classifier()


class ClassifyWorkload:
    name = "cls"

    def __init__(self, args, device):
        import torch

        from .corpus import CORPUS_FILES, load_corpus
        self.args, self.device = args, device
        _, _, self.info = load_corpus()
        stdlib = self.info["stdlib"]
        self.train, self.val = [], []
        for c in CLASSES:
            files = [f for f in CORPUS_FILES if f.startswith(c + "/")]
            data = b"\0".join(open(os.path.join(stdlib, f), "rb").read() for f in files
                              if os.path.isfile(os.path.join(stdlib, f)))
            cut = len(data) * 9 // 10
            self.train.append(torch.frombuffer(bytearray(data[:cut]), dtype=torch.uint8))
            self.val.append(torch.frombuffer(bytearray(data[cut:]), dtype=torch.uint8))
        lm = pretrained(args, device)
        torch.manual_seed(args.seed + 1)            # the head: the same for every codec
        self.model = _Classifier.make(lm, len(CLASSES)).to(device)

    def _batch(self, step, rank, n):
        import torch
        args = self.args
        gen = torch.Generator().manual_seed(args.seed * 1_000_003 + step)
        labels = torch.randint(0, len(CLASSES), (n * args.batch,), generator=gen)
        frac = torch.rand(n * args.batch, generator=gen, dtype=torch.float64)
        mine = slice(rank * args.batch, (rank + 1) * args.batch)
        rows = []
        for c, f in zip(labels[mine].tolist(), frac[mine].tolist()):
            data = self.train[c]
            start = int(f * (len(data) - args.seq_len))
            rows.append(data[start:start + args.seq_len])
        return torch.stack(rows), labels[mine]

    def _loss(self, ids, labels, reduction="mean", call=None):
        import torch
        with _autocast(self.device):
            logits = (self.model if call is None else call)(ids.to(self.device).long())
        return torch.nn.functional.cross_entropy(logits.float(), labels.to(self.device),
                                                 reduction=reduction), logits

    def batch(self, step, rank, n):
        return self._batch(step, rank, n)

    def batch_loss(self, batch, call=None):
        return self._loss(*batch, call=call)[0]

    def loss(self, step, rank, n):
        return self.batch_loss(self.batch(step, rank, n))

    def evaluate(self) -> dict:
        """Validation loss and accuracy over up to ``val_windows`` windows
        of every package's held-out tenth."""
        import torch
        args = self.args
        total, right, count = 0.0, 0, 0
        self.model.eval()
        with torch.no_grad():
            for c, data in enumerate(self.val):
                n = min(args.val_windows, len(data) // args.seq_len)
                ids = data[:n * args.seq_len].reshape(n, args.seq_len)
                for chunk in ids.split(max(1, args.batch * 4)):
                    labels = torch.full((chunk.shape[0],), c, dtype=torch.long)
                    loss, logits = self._loss(chunk, labels, reduction="sum")
                    total += float(loss)
                    right += int((logits.argmax(dim=1).cpu() == labels).sum())
                    count += chunk.shape[0]
        self.model.train()
        return {"val_loss": total / max(1, count), "accuracy": right / max(1, count)}


def pretrained(args, device):
    """The LM of ``args`` trained ``args.pretrain_steps`` steps on the corpus
    with exact gradients in one process (batch of 8 ranks' micro-batches),
    cached on disk so that every codec fine-tunes the same weights."""
    import torch
    lm_args = _Args(args, seed=args.seed)
    key = hashlib.sha256(repr((sorted(vars(lm_args).items()), device.type,
                               torch.__version__)).encode()).hexdigest()[:16]
    cache = Path(os.environ.get("DYNAMIQ_CACHE", ".cache")) / "train_sim" / f"lm_{key}.pt"
    lm = LMWorkload(lm_args, device)
    if cache.exists():
        lm.model.load_state_dict(torch.load(cache, map_location=device))
        return lm.model
    opt = torch.optim.AdamW(lm.model.parameters(), lr=args.lr, betas=(0.9, 0.95))
    for step in range(args.pretrain_steps):
        opt.zero_grad(set_to_none=True)
        lm.loss(step, 0, 1).backward()
        opt.step()
    cache.parent.mkdir(parents=True, exist_ok=True)
    torch.save(lm.model.state_dict(), cache)
    return lm.model


class _Args:
    """The LM's hyper-parameters of a cls run (its pretraining batch: 8x)."""

    def __init__(self, args, seed):
        for k in ("hidden", "layers", "heads", "intermediate", "seq_len", "val_windows",
                  "pretrain_steps", "lr"):
            setattr(self, k, getattr(args, k))
        self.batch, self.seed = args.batch * 8, seed


WORKLOADS = {"lm": LMWorkload, "cls": ClassifyWorkload}


def make_workload(args, device):
    return WORKLOADS[args.workload](args, device)
