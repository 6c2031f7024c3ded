"""The cost model's prediction seeding ``hierarchy="auto"`` (docs/cost-model.md,
"Seeding"), alike on every rank: the predicted winner is measured first; with
given links a loser ``MARGIN`` times slower is not measured at all.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..settings import env_text

MARGIN = 2.0                 # the predicted loser at least this much slower: not measured
KERNELS = "h100-final"       # the model's kernel rates for device arrays
INTRA_LATENCY = 2e-6         # the model command's defaults (--intra-latency, --inter-latency)
INTER_LATENCY = 6e-6
DEFAULT_INTRA, DEFAULT_INTER = 400e9, 50e9     # --intra, --inter (bytes/s); a NIC per rank
LINK_KEYS = ("intra", "inter", "nics")
_MX = {"e4m3": "mxfp8", "e5m2": "mxfp8", "e3m2": "mxfp6", "e2m3": "mxfp6", "e2m1": "mxfp4"}


def default_links(value=None):
    """The links given, ``(intra, inter, nics)`` (bytes/s per direction of a
    rank's in-node link and of a NIC; NICs per node, 0: one per rank) or None,
    from ``{"intra": "400GB/s", "inter": "25GB/s", "nics": 8}``,
    ``"intra=400GB/s,inter=25GB/s,nics=8"`` or ``$DYNAMIQ_LINKS``."""
    if value is None:
        value = env_text("DYNAMIQ_LINKS", "").strip() or None
        if value is None:
            return None
    if isinstance(value, str):
        pairs = [p.partition("=") for p in value.replace(";", ",").split(",") if p.strip()]
        if any(not sep for _, sep, _ in pairs):
            raise ValueError(f"links {value!r}: write intra=400GB/s,inter=25GB/s[,nics=8] "
                             "(argument or $DYNAMIQ_LINKS)")
        value = {k.strip(): v.strip() for k, _, v in pairs}
    if not isinstance(value, dict) or set(value) - set(LINK_KEYS) or \
            not {"intra", "inter"} <= set(value):
        raise ValueError(f"links must give intra and inter (and optionally nics), got {value!r} "
                         "(argument or $DYNAMIQ_LINKS)")
    from ..cost_model.model import parse_bandwidth
    intra, inter = parse_bandwidth(value["intra"]), parse_bandwidth(value["inter"])
    try:
        nics = int(value.get("nics", 0))
    except (TypeError, ValueError):
        nics = -1
    if not (intra > 0 and inter > 0) or nics < 0:
        raise ValueError(f"links need positive bandwidths and a non-negative NIC count, got "
                         f"{value!r}")
    return (float(intra), float(inter), nics)


def model_codec(codec, length: int):
    """(the model's codec name, bits) of ``codec`` on ``length`` elements (DynamiQ
    below ``small_input`` runs as BF16), or None where the model has none."""
    name = getattr(codec, "name", None)
    if name == "dynamiq":
        return ("bf16", 16.0) if length < codec.small_input else ("dynamiq", float(codec.bits))
    if name in ("bf16", "exact"):
        return name, 16.0 if name == "bf16" else 32.0
    if name == "mxfp":
        return _MX.get(getattr(codec, "fmt", None)), 0.0
    return None


def _bandwidth(b: float) -> str:
    return f"{b / 1e9:g} GB/s"


@dataclass(frozen=True)
class Prediction:
    """The model's seconds of each option for one class of calls."""
    seconds: dict            # {"nodes": s, "flat": s}
    given: bool              # the links were given (else the defaults: order only)
    detail: str              # the inputs, for the reason strings

    @property
    def winner(self) -> str:
        return min(sorted(self.seconds), key=self.seconds.get)

    @property
    def loser(self) -> str:
        return max(sorted(self.seconds, reverse=True), key=self.seconds.get)

    @property
    def ratio(self) -> float:
        return self.seconds[self.loser] / self.seconds[self.winner]

    @property
    def decisive(self) -> bool:
        return self.given and self.ratio >= MARGIN

    def text(self) -> str:
        links = "" if self.given else "the model's default links; "
        return (f"predicted {self.winner} {self.ratio:.2f}x faster than {self.loser} "
                f"(cost model: {links}{self.detail})")

    def note(self) -> str:
        """The prediction and what it decides (for the reason strings)."""
        if not self.given:
            return (f"{self.text()}: no links given (links= or $DYNAMIQ_LINKS), both measured, "
                    f"{self.winner} first")
        if not self.decisive:
            return (f"{self.text()}: below the {MARGIN:g}x margin, both measured, "
                    f"{self.winner} first")
        return f"{self.text()}: at least the {MARGIN:g}x margin, {self.loser} not measured"


def predict_hierarchies(nodes: int, node_size: int, elements: int, itemsize: int, codec,
                        topology: str, links, on_device: bool, gather: str = "ring"):
    """The :class:`Prediction` of the flat and the hierarchical call of
    ``elements`` per rank, or None where the model lacks the codec; ``links``:
    :func:`default_links`' tuple, or None (the model's defaults); ``gather``:
    the calls' all-gather schedule."""
    flat_codec = model_codec(codec, elements)
    rail_codec = model_codec(codec, elements // node_size)
    if not flat_codec or not rail_codec or not flat_codec[0] or not rail_codec[0]:
        return None
    from ..cost_model import model as cm
    intra, inter, nics = links or (DEFAULT_INTRA, DEFAULT_INTER, 0)
    nics = nics or node_size
    rates = cm.load_rates(KERNELS)
    if not on_device:
        rates = cm.wire_only(rates)
    cluster = cm.Cluster(nodes, node_size, cm.Link(INTRA_LATENCY, intra),
                         cm.Link(INTER_LATENCY, inter), nics)
    topo = (topology,)
    flat = cm.predict(cluster, elements, rates, flat_codec[0], flat_codec[1], topo, "fixed",
                      itemsize, gather=gather)[f"flat_{topology}"]["seconds"]
    levels = cm.predict(cluster, elements, rates, rail_codec[0], rail_codec[1], topo, "fixed",
                        itemsize, gather=gather)[f"levels_{topology}"]["seconds"]
    detail = (f"{nodes} nodes x {node_size}, intra {_bandwidth(intra)}, inter "
              f"{_bandwidth(inter)} x {nics} NIC(s), 2^{max(elements, 1).bit_length() - 1} "
              f"elements, {flat_codec[0]}, "
              f"{'kernels ' + KERNELS if on_device else 'wire only'}")
    return Prediction({"nodes": levels, "flat": flat}, links is not None, detail)
