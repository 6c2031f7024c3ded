"""Is the compressed run's loss gap the codec's variance, or something else?

Trains like ``python -m research train-sim`` (simulated ranks, AdamW) with
two diagnostic reductions besides the codecs train-sim knows:

* ``avg<K>:<codec>``: the mean of K independent draws of the codec (seeds
  ``seed * 1000 + k``): the same bias, a K-th of the variance;
* ``gauss:<codec>``: the exact mean plus isotropic Gaussian noise whose norm
  is the codec's own error on that call: the same vNMSE, spread evenly over
  the coordinates instead of where the codec puts it.

    python research/scripts/loss_gap.py --codec gauss:dynamiq:5 --ranks 4 --hidden 256 \\
        --layers 4 --heads 4 --intermediate 704 --seq-len 128 --batch 4 --steps 300 \\
        --lr 1e-3 --warmup 30 --eval-every 50 --val-windows 16 --device cpu --json out.json
"""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import torch  # noqa: E402

from research import train_sim  # noqa: E402

_Reducer = train_sim.Reducer


class DiagnosticReducer(_Reducer):
    def __init__(self, spec, n, seed, topology, node_size, on_host=False):
        self.mode, self.k = None, 1
        head, _, rest = spec.partition(":")
        if head.startswith("avg") and head[3:].isdigit():
            self.mode, self.k, spec = "avg", int(head[3:]), rest
        elif head == "gauss":
            self.mode, spec = "gauss", rest
        super().__init__(spec, n, seed, topology, node_size, on_host)
        self.base_seed = seed
        self.noise = torch.Generator().manual_seed(seed + 12345)

    def _codec(self, xs):
        if self.mode == "avg":
            outs, bits, coords = [], self.bits, self.coords
            for k in range(self.k):
                self.seed = self.base_seed * 1000 + k
                outs.append(super()._codec(xs).double())
            self.seed = self.base_seed
            self.bits = bits + (self.bits - bits) / self.k       # one draw's bits
            self.coords = coords + (self.coords - coords) / self.k
            return (sum(outs) / self.k).float()
        out = super()._codec(xs)
        if self.mode == "gauss":
            exact = torch.zeros_like(xs[0], dtype=torch.float64)
            for x in xs:
                exact += x.double()
            exact /= self.n
            err = float((out.double() - exact).norm())
            g = torch.randn(exact.shape, generator=self.noise, dtype=torch.float64)
            out = (exact + g * (err / float(g.norm()))).float()
        return out


if __name__ == "__main__":
    train_sim.Reducer = DiagnosticReducer
    train_sim.main()
