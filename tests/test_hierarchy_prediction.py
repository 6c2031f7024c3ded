"""The cost model's prediction that seeds hierarchy="auto"
(dynamiq_mpi/call/prediction.py): its numbers are the cost model's own
(cost_model/model.py), its two documented anchors (docs/cost-model.md,
"The issue's two sanity points"), the links a collective is given, and how
the hierarchy chooser (call/paths.py) uses a prediction.  The MPI side
(every rank alike, the output's bits) is tests/mpi/test_hierarchy_mpi.py."""
import pytest
from mpi4py import MPI

import dynamiq_mpi as dq
from dynamiq_mpi.call import prediction as pr
from dynamiq_mpi.call.paths import PathChooser
from dynamiq_mpi.cost_model import model as cm


def model(nodes, k, intra, inter, nics, elements, codec="dynamiq", bits=5.0, topology="ring",
          in_bytes=2, wire=False):
    """The cost model asked directly, as its command asks it."""
    rates = cm.load_rates("h100-final")
    if wire:
        rates = cm.wire_only(rates)
    c = cm.Cluster(nodes, k, cm.Link(2e-6, intra), cm.Link(6e-6, inter), nics)
    return cm.predict(c, elements, rates, codec, bits, (topology,), "fixed", in_bytes)


@pytest.mark.parametrize("topology", ["ring", "butterfly"])
def test_the_prediction_is_the_cost_model_s(topology):
    links = pr.default_links("intra=400GB/s,inter=200Gb/s,nics=2")
    p = pr.predict_hierarchies(16, 8, 1 << 28, 2, dq.DynamiQ(bits=5), topology, links, True)
    ref = model(16, 8, 400e9, 25e9, 2, 1 << 28, topology=topology)
    assert p.seconds == {"nodes": ref[f"levels_{topology}"]["seconds"],
                         "flat": ref[f"flat_{topology}"]["seconds"]}
    # host arrays: the links alone (the GPU kernels' rates say nothing of the CPU codec)
    p = pr.predict_hierarchies(4, 2, 1 << 20, 4, dq.DynamiQ(bits=6, small_input=0), topology,
                               links, False)
    ref = model(4, 2, 400e9, 25e9, 2, 1 << 20, bits=6.0, topology=topology, in_bytes=4,
                wire=True)
    assert p.seconds == {"nodes": ref[f"levels_{topology}"]["seconds"],
                         "flat": ref[f"flat_{topology}"]["seconds"]}
    assert "wire only" in p.text() and "4 nodes x 2" in p.text()


def test_the_documented_sanity_points():
    """docs/cost-model.md: 16 x 8 GPUs with 2 x 200Gb/s NICs, kernels, host
    fixed: flat 0.96x and levels 2.36x NCCL (nodes 2.46x flat: decisive); the
    paper's testbed, 4 x 2 with NV4 and one 100Gb/s NIC: flat 2.97x, levels
    2.45x (flat 1.21x nodes: measured)."""
    rail = pr.predict_hierarchies(16, 8, 1 << 28, 2, dq.DynamiQ(), "ring",
                                  pr.default_links("intra=400GB/s,inter=200Gb/s,nics=2"), True)
    assert rail.winner == "nodes" and rail.ratio == pytest.approx(2.36 / 0.96, abs=0.02)
    assert rail.decisive and "flat not measured" in rail.note()
    paper = pr.predict_hierarchies(4, 2, 1 << 28, 2, dq.DynamiQ(), "ring",
                                   pr.default_links("intra=56GB/s,inter=100Gb/s,nics=1"), True)
    assert paper.winner == "flat" and paper.ratio == pytest.approx(2.97 / 2.45, abs=0.02)
    assert not paper.decisive and "both measured, flat first" in paper.note()


def test_the_margin_and_links_not_given():
    fast_nics = pr.default_links("intra=100GB/s,inter=1MB/s,nics=2")
    one_nic = pr.default_links("intra=100GB/s,inter=1MB/s,nics=1")
    x = dict(nodes=2, node_size=2, elements=1 << 12, itemsize=4,
             codec=dq.DynamiQ(small_input=0), topology="ring", on_device=False)
    decisive = pr.predict_hierarchies(links=fast_nics, **x)
    assert decisive.winner == "nodes" and decisive.ratio >= pr.MARGIN and decisive.decisive
    close = pr.predict_hierarchies(links=one_nic, **x)
    assert close.winner == "nodes" and 1 < close.ratio < pr.MARGIN and not close.decisive
    # the model's defaults order the measurement, never skip it
    default = pr.predict_hierarchies(links=None, **x)
    assert not default.given and not default.decisive
    assert "no links given" in default.note() and "default links" in default.text()
    huge = pr.Prediction({"nodes": 1.0, "flat": 9.0}, False, "")
    assert huge.ratio == 9.0 and not huge.decisive
    assert pr.Prediction({"nodes": 1.0, "flat": 2.0}, True, "").decisive       # >= the margin
    assert not pr.Prediction({"nodes": 1.0, "flat": 1.99}, True, "").decisive


def test_codecs_the_model_knows():
    links = pr.default_links("intra=400GB/s,inter=50GB/s")
    small = dq.DynamiQ(small_input=1 << 20)
    assert pr.model_codec(small, 1 << 20) == ("dynamiq", 5.0)
    assert pr.model_codec(small, (1 << 20) - 1) == ("bf16", 16.0)
    assert pr.model_codec(dq.MXFP("e2m1"), 10)[0] == "mxfp4"
    assert pr.model_codec(dq.Exact(), 10)[0] == "exact"
    assert pr.model_codec(dq.THC(), 1 << 20) is None
    assert pr.predict_hierarchies(2, 4, 1 << 20, 2, dq.OmniReduce(0.5), "ring", links,
                                  True) is None
    # the rails run below small_input where the whole call does not: BF16 on the rails
    p = pr.predict_hierarchies(2, 4, 1 << 21, 2, dq.DynamiQ(small_input=1 << 20), "ring",
                               links, True)
    assert p.seconds["flat"] == model(2, 4, 400e9, 50e9, 4, 1 << 21)["flat_ring"]["seconds"]
    assert p.seconds["nodes"] == model(2, 4, 400e9, 50e9, 4, 1 << 21, codec="bf16",
                                       bits=16.0)["levels_ring"]["seconds"]


def test_links_from_arguments_and_the_environment(monkeypatch):
    monkeypatch.delenv("DYNAMIQ_LINKS", raising=False)
    assert pr.default_links() is None
    assert pr.default_links("intra=400GB/s, inter=200Gb/s, nics=8") == (400e9, 25e9, 8)
    assert pr.default_links({"intra": 400, "inter": "25GB/s"}) == (400e9, 25e9, 0)
    monkeypatch.setenv("DYNAMIQ_LINKS", "intra=56GB/s,inter=100Gbps,nics=1")
    assert pr.default_links() == (56e9, 12.5e9, 1)
    assert dq.Collective(MPI.COMM_SELF).links == (56e9, 12.5e9, 1)
    assert dq.Collective(MPI.COMM_SELF, links="intra=1,inter=2").links == (1e9, 2e9, 0)
    for bad in ("intra=400GB/s", "inter=1GB/s,intra=fast", "intra=1,inter=1,nics=-1",
                "intra=1,inter=1,wan=3", "400GB/s", {"intra": 0, "inter": 1}):
        with pytest.raises(ValueError):
            pr.default_links(bad)


class _Stub:
    """A prediction as the chooser sees one."""

    def __init__(self, winner, decisive):
        self.winner, self.decisive = winner, decisive

    def text(self):
        return f"predicted {self.winner}"

    def note(self):
        return f"predicted {self.winner}, " + ("decisive" if self.decisive else "measured")


def test_the_chooser_measures_the_predicted_winner_first_or_keeps_it():
    ch = PathChooser(MPI.COMM_SELF, options=("nodes", "flat"))
    key = ("cpu", "float32", 12)
    asked = []

    def predict(stub):
        return lambda: asked.append(stub) or stub

    # indecisive, flat predicted: flat first, then alternating; the measured result wins
    ran = []
    for _ in range(6):
        choice, why, timed = ch.choose(key, predict=predict(_Stub("flat", 0)))
        assert timed and "measuring" in why and "predicted flat, measured" in why
        ran.append(choice)
        ch.record(key, choice, 1.0 if choice == "nodes" else 3.0, choice)
    assert ran == ["flat", "nodes"] * 3 and len(asked) == 1      # predicted once per class
    choice, why, timed = ch.choose(key)
    assert (choice, timed) == ("nodes", False)                   # measured nodes 3x faster
    assert why.startswith("auto: measured") and why.endswith("predicted flat")
    # decisive: kept at once, the loser never run
    choice, why, timed = ch.choose(("cpu", "float32", 13),
                                   predict=predict(_Stub("nodes", 1)))
    assert (choice, timed) == ("nodes", False) and why == "auto: predicted nodes, decisive"
    assert ch.decisions()[("cpu", "float32", 13)] == ("nodes", why)
    # no prediction: as before (the options' order)
    assert ch.choose(("cpu", "float32", 14), predict=lambda: None)[0] == \
        "nodes"
