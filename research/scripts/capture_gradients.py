"""Capture real gradients for the error study (``python -m research vnmse``).

    python research/scripts/capture_gradients.py --out .cache/gradients/llama_words

A small LLaMA (transformers, randomly initialised, CPU) is trained for
``--steps`` steps on Python's standard library source (the corpus of
mpi_examples/train_lm.py, its training split) with a *word-level*
vocabulary: the ``--vocab - 1`` most frequent tokens of the corpus (words,
numbers, punctuation characters) plus ``<unk>``, by descending frequency.
Then, at that one model step, the gradient of each of ``--ranks`` distinct
micro-batches is captured: rank ``r`` of the study is micro-batch ``r``.  A
word absent from a micro-batch gets an exactly zero embedding row, so the
embedding table is skewed the way the paper's fine-tuning gradients are.

Saved: ``OUT.npy`` (float32, ranks x length), a contiguous slice of whole
tensors in the model's parameter order (the embedding table, every decoder
layer, the final norm; the LM head only with ``--include-head``), and
``OUT.json`` (model, tensors and their offsets, ``dense_start`` = where the
embedding ends, corpus digest, zero-row statistics, the array's sha256).
Deterministic for a given torch build and thread count (``--threads``).
Takes well under a minute on one CPU core with the defaults.
"""
from __future__ import annotations

import argparse
import collections
import hashlib
import importlib.util
import json
import os
import re
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[2]
TOKEN = re.compile(r"[A-Za-z_][A-Za-z_0-9]*|[0-9]+|\S")


def _train_lm():
    spec = importlib.util.spec_from_file_location("train_lm", REPO / "mpi_examples" / "train_lm.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def tokenize(data: bytes) -> list:
    return TOKEN.findall(data.decode("utf-8", errors="replace"))


def build_vocab(tokens, size: int) -> dict:
    """``<unk>`` = 0, then the ``size - 1`` most frequent tokens (ties by text)."""
    counts = collections.Counter(tokens)
    words = sorted(counts, key=lambda w: (-counts[w], w))[:size - 1]
    return {"<unk>": 0, **{w: i + 1 for i, w in enumerate(words)}}


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", default=str(REPO / ".cache" / "gradients" / "llama_words"),
                   help="output path without extension (.npy and .json are written)")
    p.add_argument("--ranks", type=int, default=64, help="micro-batches (ranks) captured")
    p.add_argument("--vocab", type=int, default=4096, help="word-level vocabulary size")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--intermediate", type=int, default=176)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch", type=int, default=16, help="sequences per training step")
    p.add_argument("--micro-batch", type=int, default=8, help="sequences per captured rank")
    p.add_argument("--steps", type=int, default=60, help="training steps before the capture")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--include-head", action="store_true", help="also keep the LM head")
    p.add_argument("--corpus-bytes", type=int, default=None,
                   help="use only the first N bytes of the training split (tests)")
    return p.parse_args(argv)


def main(argv=None):
    args = parse_args(sys.argv[1:] if argv is None else argv)
    t0 = time.perf_counter()
    import torch
    import transformers
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.set_num_threads(args.threads)
    transformers.logging.set_verbosity_error()

    train_b, _, corpus = _train_lm().load_corpus()
    if args.corpus_bytes:
        train_b = train_b[:args.corpus_bytes]
    tokens = tokenize(train_b)
    vocab = build_vocab(tokens, args.vocab)
    ids = torch.tensor([vocab.get(t, 0) for t in tokens], dtype=torch.int64)
    unk = float((ids == 0).float().mean())
    print(f"corpus: {len(tokens)} tokens, {len(set(tokens))} distinct, vocabulary {len(vocab)} "
          f"(<unk> {unk:.1%} of tokens)", file=sys.stderr, flush=True)

    torch.manual_seed(args.seed)
    cfg = LlamaConfig(vocab_size=len(vocab), hidden_size=args.hidden,
                      intermediate_size=args.intermediate, num_hidden_layers=args.layers,
                      num_attention_heads=args.heads, num_key_value_heads=args.heads,
                      max_position_embeddings=args.seq_len, tie_word_embeddings=False,
                      bos_token_id=None, eos_token_id=None, pad_token_id=None)
    model = LlamaForCausalLM(cfg)
    gen = torch.Generator().manual_seed(args.seed)

    def windows(count):
        starts = torch.randint(0, len(ids) - args.seq_len - 1, (count,), generator=gen)
        return ids[starts[:, None] + torch.arange(args.seq_len + 1)]

    def loss_of(w):
        logits = model(input_ids=w[:, :-1]).logits
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                 w[:, 1:].reshape(-1))

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    loss = float("nan")
    for step in range(args.steps):
        for g in opt.param_groups:
            g["lr"] = args.lr * min(1.0, (step + 1) / max(1, args.steps // 10))
        opt.zero_grad(set_to_none=True)
        loss_t = loss_of(windows(args.batch))
        loss_t.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        loss = loss_t.item()
        if step % max(1, args.steps // 5) == 0 or step == args.steps - 1:
            print(f"step {step + 1}/{args.steps}: loss {loss:.3f}", file=sys.stderr, flush=True)

    params = [(n, p) for n, p in model.named_parameters()
              if args.include_head or not n.startswith("lm_head")]
    tensors, offset = [], 0
    for name, p in params:
        tensors.append({"name": name, "shape": list(p.shape), "offset": offset,
                        "numel": p.numel()})
        offset += p.numel()
    length = offset
    dense_start = tensors[0]["numel"]           # the embedding table comes first
    assert tensors[0]["name"].endswith("embed_tokens.weight"), tensors[0]["name"]
    grads = np.empty((args.ranks, length), dtype=np.float32)
    losses = []
    for r in range(args.ranks):                 # the same model step for every rank
        model.zero_grad(set_to_none=True)
        loss_t = loss_of(windows(args.micro_batch))
        loss_t.backward()
        losses.append(loss_t.item())
        grads[r] = torch.cat([p.grad.reshape(-1) for _, p in params]).numpy()

    emb = grads[:, :dense_start].reshape(args.ranks, len(vocab), args.hidden)
    zero_rows = (emb == 0).all(axis=2)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp.npy")
    np.save(tmp, grads)
    os.replace(tmp, out.with_suffix(".npy"))
    meta = {
        "model": {"kind": "LlamaForCausalLM (random init, then trained)", "vocab": len(vocab),
                  "hidden": args.hidden, "layers": args.layers, "heads": args.heads,
                  "intermediate": args.intermediate, "seq_len": args.seq_len,
                  "parameters": sum(p.numel() for p in model.parameters())},
        "tensors": tensors, "length": length, "dense_start": dense_start,
        "ranks": args.ranks, "micro_batch": args.micro_batch, "steps": args.steps,
        "batch": args.batch, "lr": args.lr, "corpus_bytes": len(train_b), "seed": args.seed,
        "threads": args.threads,
        "train_loss_last": loss, "micro_batch_loss_mean": float(np.mean(losses)),
        "corpus": {k: corpus[k] for k in ("sha256", "python", "files_train", "bytes_train")},
        "tokens": len(tokens), "unk_fraction": unk,
        "embedding_rows_zero_per_rank_mean": float(zero_rows.mean()),
        "embedding_rows_zero_on_all_8": float(zero_rows[:8].all(axis=0).mean()),
        "embedding_rows_zero_on_all_ranks": float(zero_rows.all(axis=0).mean()),
        "torch": torch.__version__, "transformers": transformers.__version__,
        "sha256": hashlib.sha256(grads.tobytes()).hexdigest(),
        "seconds": time.perf_counter() - t0,
    }
    with open(out.with_suffix(".json"), "w") as f:
        json.dump(meta, f, indent=1)
    print(f"captured {args.ranks} x {length} gradients ({dense_start} embedding) into "
          f"{out.with_suffix('.npy')} in {meta['seconds']:.1f} s; embedding rows zero on all "
          f"of 8 ranks: {meta['embedding_rows_zero_on_all_8']:.1%}", file=sys.stderr)
    return meta


if __name__ == "__main__":
    main()
