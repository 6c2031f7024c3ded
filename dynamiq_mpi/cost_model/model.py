"""``python -m dynamiq_mpi model``: predicted time of an all-reduce on a cluster (CPU only).

    python -m dynamiq_mpi model --nodes 16 --gpus-per-node 8 --intra 400GB/s \\
        --inter 50GB/s --nics-per-node 8 --elements 2^28 --bits 5
    python -m dynamiq_mpi model ... --json -                   # the same as JSON
    python -m dynamiq_mpi model ... --sweep inter=3GB/s,12.5GB/s,50GB/s --plot sweep.png

Predicted (docs/cost-model.md): NCCL's BF16 ring over all ``n = N K`` ranks,
our flat compressed all-reduce and our hierarchical one (NCCL in the node, K
compressed rails sharing the node's NICs).  A compressed call replays the
engine's schedule for one rank: per tile a kernel at measured rates
(``kernel_rates.json``), per message ``alpha + bytes / beta``; plus the
statistics, the planner and the host's time (``--host``).
"""
from __future__ import annotations

import json
import math
import re
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from .. import schedules

RATES_FILE = Path(__file__).with_name("kernel_rates.json")
SUPER = 256                       # entries per DynamiQ super-group
STATS_BITS = 64                   # DynamiQ statistics per super-group: mean and norm, float32
DEFAULT_TILE_BYTES = 32 << 20     # codecs/base.py
WIDTHS = (2, 4, 8)
HOST_MODES = ("exact", "fixed", "eager", "graph")

# ------------------------------------------------------------------ units
_SI = {"": 1, "k": 1e3, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12,
       "Ki": 2 ** 10, "Mi": 2 ** 20, "Gi": 2 ** 30, "Ti": 2 ** 40}


def parse_bandwidth(text) -> float:
    """Bytes/s from '400GB/s', '200Gb/s', '25GBps', '12.5GiB/s'; a bare number: GB/s."""
    if isinstance(text, (int, float)):
        return float(text) * 1e9
    m = re.fullmatch(r"\s*([0-9.]+(?:[eE][-+]?\d+)?)\s*([kKMGT]i?)?\s*(B|b)?\s*(/s|ps)?\s*",
                     str(text))
    if not m or (m.group(2) and not m.group(3)):
        raise ValueError(f"bandwidth {text!r}: write e.g. 400GB/s, 200Gb/s or 25 (GB/s)")
    value, prefix, unit = float(m.group(1)), m.group(2) or "", m.group(3)
    if unit is None:
        return value * 1e9
    return value * _SI[prefix] / (8 if unit == "b" else 1)


def parse_count(text) -> int:
    """Elements from '2^28', '2**28', '1<<28', '268435456', '256Mi', '1e8'."""
    s = str(text).strip().replace("_", "")
    m = re.fullmatch(r"(\d+)\s*(\^|\*\*)\s*(\d+)", s) or re.fullmatch(r"(\d+)\s*(<<)\s*(\d+)", s)
    if m:
        a, b = int(m.group(1)), int(m.group(3))
        return a ** b if m.group(2) != "<<" else a << b
    m = re.fullmatch(r"([0-9.]+(?:[eE][-+]?\d+)?)\s*([kKMGT]i?)?", s)
    if not m:
        raise ValueError(f"count {text!r}: write e.g. 2^28, 268435456 or 256Mi")
    value = float(m.group(1)) * _SI[m.group(2) or ""]
    if value != int(value) or value < 0:
        raise ValueError(f"count {text!r} is not a whole non-negative number")
    return int(value)


def parse_time(text) -> float:
    """Seconds from '5us', '2ms', '1e-6s', '800ns'; a bare number is microseconds."""
    if isinstance(text, (int, float)):
        return float(text) * 1e-6
    m = re.fullmatch(r"\s*([0-9.]+(?:[eE][-+]?\d+)?)\s*(ns|us|µs|ms|s)?\s*", str(text))
    if not m:
        raise ValueError(f"time {text!r}: write e.g. 5us or 0.02ms")
    scale = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, None: 1e-6}[m.group(2)]
    return float(m.group(1)) * scale


# ------------------------------------------------------------------ kernel rates
def _bench_rows(doc):
    """Rows of a kernel benchmark JSON, or of every round of an A/B file
    (``{"new_round1": {...}, ...}``: the ``new`` rounds), times averaged."""
    if "rows" in doc:
        runs = [doc]
    else:
        runs = [v for k, v in sorted(doc.items()) if k.startswith("new") and "rows" in v]
    acc = defaultdict(list)
    for run in runs:
        for r in run["rows"]:
            acc[(r["kernel"], r["log2n"])].append(r)
    return runs[0], {k: (sum(r["time_ms"] for r in v) / len(v), v[0]["bytes"])
                     for k, v in acc.items()}


def rates_from_kernel_bench(doc, source="") -> dict:
    """The model's rates (ns per element, per size) from a kernel benchmark JSON."""
    head, rows = _bench_rows(doc)
    out = {"source": source, "device": head.get("device"), "measured": head.get("date"),
           "command": head.get("command"), "copy_gbps": {}, "ns_per_element": {}}
    names = {"stats": "dq statistics (centred)", "bf16_cast": "bf16 cast f32->bf16 (ours)",
             "bf16_add": "bf16 add bf16+bf16->bf16 (ours)", "copy": "copy D2D (bf16 input bytes)"}
    for w in WIDTHS:
        names[f"compress_w{w}"] = f"dq compress w={w}"
        names[f"compress_w{w}_corr"] = f"dq compress w={w} corr n=8"
        names[f"dar_w{w}"] = f"dq fused dar w={w}"
        names[f"dar_w{w}_corr"] = f"dq fused dar w={w} corr n=8"
        names[f"decompress_w{w}"] = f"dq decompress w={w}"
        names[f"dacc_w{w}"] = f"dq decompress-accumulate w={w}"
    for log2n in sorted({k[1] for k in rows}):
        per = {}
        for key, kernel in names.items():
            if (kernel, log2n) in rows:
                t_ms, nbytes = rows[(kernel, log2n)]
                per[key] = t_ms * 1e6 / 2 ** log2n
                if key == "copy":
                    out["copy_gbps"][str(log2n)] = nbytes / (t_ms * 1e-3) / 1e9   # read + write
        out["ns_per_element"][str(log2n)] = per
    return out


def load_rates(name_or_path="h100-final") -> dict:
    """A rate set of ``kernel_rates.json``, or a kernel benchmark JSON's at a path."""
    shared = json.loads(RATES_FILE.read_text())
    if name_or_path in shared["sets"]:
        rates = dict(shared["sets"][name_or_path], name=name_or_path)
    else:
        p = Path(name_or_path)
        if not p.is_file():
            raise SystemExit(f"--gpu {name_or_path!r}: not a rate set ({', '.join(shared['sets'])}) "
                             "nor a kernel benchmark JSON file "
                             "(python -m research kernels --json)")
        rates = dict(rates_from_kernel_bench(json.loads(p.read_text()), str(p)), name=p.name)
    for key in ("planner_us", "host_us", "launch_us", "default_widths", "in_call_factor"):
        rates[key] = shared[key]
    return rates


def wire_only(rates):
    """The rates with every kernel, planner and host cost at zero: alpha-beta only."""
    return dict(rates, host_us={k: 0.0 for k in rates["host_us"]}, launch_us=0.0,
                copy_gbps={"28": float("inf")}, planner_us={"20": 0.0, "28": 0.0},
                ns_per_element={k: dict.fromkeys(v, 0.0)
                                for k, v in rates["ns_per_element"].items()})


def kernel_ns(rates, key, elements):
    """ns per element of a kernel at this size: log-linear between measured sizes, clamped."""
    table = rates["ns_per_element"]
    sizes = sorted(int(k) for k in table if key in table[k])
    x = math.log2(max(elements, 1))
    if x <= sizes[0] or len(sizes) == 1:
        return table[str(sizes[0])][key]
    if x >= sizes[-1]:
        return table[str(sizes[-1])][key]
    lo = max(s for s in sizes if s <= x)
    hi = min(s for s in sizes if s >= x)
    if lo == hi:
        return table[str(lo)][key]
    f = (x - lo) / (hi - lo)
    return table[str(lo)][key] * (1 - f) + table[str(hi)][key] * f


# ------------------------------------------------------------------ codecs
@dataclass(frozen=True)
class CodecCost:
    """Per-element kernel seconds of one codec at one tile size, and its wire."""
    name: str
    wire_bits: float          # data bits per coordinate on each hop (statistics apart)
    stats_bytes: float        # statistics bytes per coordinate (0: none)
    planner: bool
    compress: float
    dar: float                # fused decompress-accumulate-recompress
    dacc: float               # decompress-accumulate (butterfly: all children but the last)
    decode: float             # decode into the caller's dtype
    pieces: int = 1           # kernels per tile operation (DynamiQ: one per width present)


def codec_cost(codec, bits, rates, tile_elements, widths=None, correlated=True,
               in_bytes=2) -> CodecCost:
    """``codec``: dynamiq, bf16, exact, mxfp8, mxfp6, mxfp4; ``widths``: DynamiQ's
    super-groups per width ({0,2,4,8,16} -> count), default the 5-bit mix."""
    f_call = rates.get("in_call_factor", 1.0)
    ns = lambda key: kernel_ns(rates, key, tile_elements) * 1e-9 * f_call   # noqa: E731
    mem = lambda nbytes: nbytes / copy_rate(rates) * f_call             # noqa: E731
    bf16_cast = ns("bf16_cast") / 6        # s per byte moved by our BF16 kernels
    bf16_add = ns("bf16_add") / 6
    if codec == "dynamiq":
        mix = {int(k): float(v) for k, v in (widths or rates["default_widths"]).items()
               if str(k).isdigit()}
        total = sum(mix.values())
        f = {w: mix.get(w, 0.0) / total for w in (0, 2, 4, 8, 16)}
        c = "_corr" if correlated else ""
        # code bytes per element of width w (record: codes, group codes, unit): spec 2
        rec = {w: (16 * (2 * w + 1) + 2) / SUPER for w in WIDTHS}
        comp = sum(f[w] * ns(f"compress_w{w}{c}") for w in WIDTHS) + f[16] * 4 * bf16_cast
        dar = sum(f[w] * ns(f"dar_w{w}{c}") for w in WIDTHS) + f[16] * 6 * bf16_add
        dacc = sum(f[w] * ns(f"dacc_w{w}") for w in WIDTHS) + f[16] * mem(10)
        # the bench's decompress writes float32; the call decodes into the input dtype
        dec = sum(f[w] * ns(f"decompress_w{w}") * (rec[w] + in_bytes) / (rec[w] + 4) for w in WIDTHS)
        dec += f[16] * mem(2 + in_bytes)
        return CodecCost(f"dynamiq:{bits:g}", bits - STATS_BITS / SUPER, STATS_BITS / SUPER / 8,
                         True, comp, dar, dacc, dec, sum(f[w] > 0 for w in (2, 4, 8, 16)))
    if codec == "bf16":
        return CodecCost("bf16", 16, 0, False, (in_bytes + 2) * bf16_cast, 6 * bf16_add,
                         mem(10), mem(2 + in_bytes))
    if codec == "exact":
        return CodecCost("exact", 32, 0, False, mem(in_bytes + 4), mem(8 + in_bytes + 4),
                         mem(12), mem(4 + in_bytes))
    mx = {"mxfp8": 8.25, "mxfp6": 6.25, "mxfp4": 4.25}
    if codec in mx:
        # no measured MX rates: memory-bound at our BF16 add's rate
        b = mx[codec] / 8
        return CodecCost(codec, mx[codec], 1 / 32, False, (in_bytes + b) * bf16_add,
                         (2 * b + in_bytes) * bf16_add, mem(b + 8), mem(b + in_bytes))
    raise ValueError(f"unknown codec {codec!r}: dynamiq, bf16, exact, mxfp8, mxfp6, mxfp4")


# ------------------------------------------------------------------ links and the pipeline
@dataclass(frozen=True)
class Link:
    """One flow's alpha-beta: seconds per message, bytes per second per direction."""
    alpha: float
    beta: float

    def time(self, nbytes):
        return self.alpha + nbytes / self.beta


def _rounds(topology, n, gather="ring", grouped=True):
    """(reduce-scatter rounds, all-gather rounds) of rank 0, as the library runs
    them: lists of steps posted together (``grouped=False``: every step
    alone, as versions before rounds ran the butterfly)."""
    reduce = schedules.rounds(schedules.reduce_steps(topology, 0, n))
    if not grouped:
        reduce = [[st] for g in reduce for st in g]
    return reduce, schedules.rounds(schedules.gather_steps(gather, 0, n))


def data_phase(n, topology, chunk_elements, cost: CodecCost, link_for, tile_bytes,
               launch, start=0.0, host=None, gather="ring", grouped=True) -> dict:
    """Device time of the data phases of one compressed call (run_schedule
    replayed for rank 0; by symmetry a message arrives when this rank's own
    of the same step and tile has crossed).  ``link_for(distance)``: a
    step's flow; ``start``: when the device may begin; ``host``: ``(t0,
    per_message)``, an eager host issuing each message and its kernel in
    turn from ``t0`` (None: all issued at once, a replayed graph).  A round
    of several steps (one peer, one NCCL group) pays its flow's latency once."""
    chunk_bytes = chunk_elements * cost.wire_bits / 8
    tiles = max(1, math.ceil(chunk_bytes / tile_bytes))
    tb, te = chunk_bytes / tiles, chunk_elements / tiles
    gpu = link = start
    issued, per_message = host if host else (start, 0.0)
    busy = {"kernels": 0.0, "wire": 0.0}

    def kernel(ready, per_element):
        nonlocal gpu
        dur = per_element * te + launch * cost.pieces
        gpu = max(gpu, ready, issued) + dur
        busy["kernels"] += dur
        return gpu

    def issue():
        nonlocal issued
        issued += per_message            # the host issues the next message and its kernel
        return 0.0

    def send(ready, distance, count=1):
        nonlocal link
        flow = link_for(distance)
        dur = flow.alpha + count * tb / flow.beta
        link = max(link, ready, issued) + dur
        busy["wire"] += dur
        return link

    def reduce_tile(received):
        if not received:
            return kernel(0.0, cost.compress)
        for arrived in received[:-1]:
            kernel(arrived, cost.dacc)
        return kernel(received[-1], cost.dar)

    reduce, gather_rounds = _rounds(topology, n, gather, grouped)
    pending = defaultdict(list)          # (chunk, tile) -> arrival times of partial sums
    for group in reduce:
        distance = group[0].dest % n
        if len(group) == 1:              # tiles pipelined: each sent once computed
            st = group[0]
            for k in range(tiles):
                issue()
                arrived = send(reduce_tile(pending.pop((st.send_chunk, k), [])), distance)
                pending[(st.recv_chunk, k)].append(arrived)
            continue
        ready = 0.0                      # every payload of the round, then one group
        for st in group:
            for k in range(tiles):
                issue()
                ready = max(ready, reduce_tile(pending.pop((st.send_chunk, k), [])))
        arrived = send(ready, distance, len(group) * tiles)
        for st in group:
            for k in range(tiles):
                pending[(st.recv_chunk, k)].append(arrived)
    arrivals = []
    if gather_rounds:
        own = gather_rounds[0][0].send_chunk
        for k in range(tiles):           # the sink's last fused step, sent at once, then decoded
            issue()
            arrivals.append(send(reduce_tile(pending.pop((own, k), [])), 1))
            kernel(0.0, cost.decode)
        for k in range(tiles):
            kernel(arrivals[k], cost.decode)
        held = list(arrivals)            # when each held tile's bytes were here
        for group in gather_rounds[1:]:
            distance = group[0].dest % n
            if gather == "ring":         # forward what arrived, decode what arrives
                arrivals = [send(a + issue(), distance) for a in arrivals]
            else:                        # held chunks, the round's messages as one group
                for _ in range(len(group) * tiles):
                    issue()
                arrived = send(max(held), distance, len(group) * tiles)
                arrivals = [arrived] * (len(group) * tiles)
            held += arrivals
            for a in arrivals:
                kernel(a, cost.decode)
    else:                                # one rank: compress and decode its own values
        kernel(kernel(0.0, cost.compress), cost.decode)
    steps = sum(len(g) for g in reduce) + sum(len(g) for g in gather_rounds)
    return {"seconds": max(gpu, link) - start, "end": max(gpu, link), "host_end": issued,
            "tiles": tiles, "hops": steps * tiles, "rounds": len(reduce) + len(gather_rounds),
            "gather": gather, **busy}


def planner_seconds(rates, elements):
    """The device planner's time, log-linear between its measured sizes."""
    pts = sorted((int(k), v) for k, v in rates["planner_us"].items() if k.isdigit())
    x = math.log2(max(elements, 2))
    if x <= pts[0][0]:
        return pts[0][1] * 1e-6
    for (a, ta), (b, tb) in zip(pts, pts[1:]):
        if x <= b:
            return (ta + (tb - ta) * (x - a) / (b - a)) * 1e-6
    (a, ta), (b, tb) = pts[-2], pts[-1]
    return (tb + (tb - ta) * (x - b) / (b - a)) * 1e-6


def compressed_allreduce(n, elements, cost_at, link_for, rates, topology="ring",
                         host="fixed", tile_bytes=DEFAULT_TILE_BYTES, in_bytes=2,
                         stats_direct=(schedules.STATS_DIRECT_RANKS,
                                       schedules.STATS_DIRECT_BYTES),
                         gather=schedules.DEFAULT_GATHER, grouped=True) -> dict:
    """Seconds of one compressed call of ``elements`` per rank over ``n`` ranks,
    and its parts; ``cost_at(tile_elements) -> CodecCost``; ``stats_direct``:
    up to how many ranks and bytes the statistics travel directly (a recorded
    run's own: see research/model_check_runs.py); ``gather``: the all-gather's
    schedule (a recorded run's own); ``grouped=False``: the butterfly's
    levels posted step by step (runs recorded before rounds)."""
    if host not in HOST_MODES:
        raise ValueError(f"host {host!r}: one of {HOST_MODES}")
    ran = topology
    if topology == "butterfly" and n & (n - 1):
        ran = "ring"                     # what a rail does there; a flat call refuses
    h = {k: v * 1e-6 for k, v in rates["host_us"].items() if isinstance(v, (int, float))}
    launch = rates["launch_us"] * 1e-6
    chunk = elements / max(n, 1)
    probe = cost_at(chunk)
    tiles = max(1, math.ceil(chunk * probe.wire_bits / 8 / tile_bytes))
    cost = cost_at(chunk / tiles)
    d = {"stats_local": 0.0, "stats_exchange": 0.0, "plan": 0.0}
    stats_messages = 0
    if cost.stats_bytes:
        d["stats_local"] = (elements * kernel_ns(rates, "stats", elements) * 1e-9
                            * rates.get("in_call_factor", 1.0) + launch)
        sbytes = elements * cost.stats_bytes
        if n == 2:                       # one exchange of the whole vector, one summing kernel
            d["stats_exchange"] = link_for(1).time(sbytes) + sbytes * 3 / copy_rate(rates) + launch
            stats_messages = 1
        elif schedules.stats_direct(n, sbytes, *stats_direct):    # two rounds, every peer
            part = sbytes / n
            links = [link_for(k) for k in range(1, n)]
            one_round = max(x.alpha for x in links) + sum(part / x.beta for x in links)
            d["stats_exchange"] = (2 * one_round + (n - 1) * part * 3 / copy_rate(rates)
                                   + (n - 1) * launch)
            stats_messages = 2
        elif n > 2:                      # the exact codec's all-reduce, same schedule
            exact = codec_cost("exact", 32, rates, sbytes / 4, in_bytes=4)
            d["stats_exchange"] = data_phase(n, ran, sbytes / 4 / n, exact, link_for,
                                             tile_bytes, launch, gather=gather,
                                             grouped=grouped)["seconds"]
            stats_messages = 2 * (n - 1)
    if cost.planner:
        d["plan"] = planner_seconds(rates, elements)
    # the caller's rows absent from the stream (DynamiQ's 0-bit class) and the mean
    d["finish"] = elements * in_bytes / copy_rate(rates) * 0.25 + launch
    per_hop = h["per_hop"]
    h_plan = h["plan"] if cost.planner else 0.0
    prologue = d["stats_local"] + d["stats_exchange"] + d["plan"]
    # the host: the agreement, the engine's work, the statistics' messages,
    host_pre = h["agree"] + h["data_base"] + per_hop * stats_messages
    if host == "exact" and cost.planner:
        # then the plan's header read back and the plan's Python
        h0 = max(host_pre, h["agree"] + prologue) + h["d2h"] + h_plan
    else:                                # fixed: no host read, the plan's Python at once
        h0 = host_pre + h_plan
    gated = data_phase(n, ran, chunk, cost, link_for, tile_bytes, launch,
                       start=h["agree"] + prologue, host=(h0, per_hop if n > 1 else 0.0),
                       gather=gather, grouped=grouped)
    data = data_phase(n, ran, chunk, cost, link_for, tile_bytes, launch, gather=gather,
                      grouped=grouped)
    d["data"] = data["seconds"]
    device = sum(d.values())
    hops = data["hops"] + stats_messages
    host_total = h["agree"] + h["data_base"] + h_plan + (per_hop * hops if n > 1 else 0.0)
    if host == "graph":                  # one replay: the work is all on the device
        total = max(h["graph_call"], device)
    elif host == "fixed":                # back-to-back calls overlap host and device
        total = max(host_total, device)
    else:                                # exact, eager: each call's end is waited for
        total = max(gated["end"] + d["finish"], gated["host_end"])
    return {"seconds": total, "device": device, "host": host_total,
            "topology": ran, "gather": gather, "rounds": data["rounds"],
            "tiles": data["tiles"], "hops": hops, "codec": cost.name,
            "wire_bits": cost.wire_bits,
            "parts": d, "kernels": data["kernels"], "wire": data["wire"]}


def copy_rate(rates):
    """Bytes per second of a device-to-device copy (read + write), the largest measured."""
    return rates["copy_gbps"][max(rates["copy_gbps"], key=int)] * 1e9


# ------------------------------------------------------------------ the cluster
@dataclass(frozen=True)
class Cluster:
    """N nodes of K GPUs: ``intra`` one GPU's NVLink, ``nic`` one NIC per
    direction, ``launch`` a collective's fixed cost, ``p2p_efficiency`` our
    point-to-point's share of the collective's network rate."""
    nodes: int
    gpus_per_node: int
    intra: Link
    nic: Link
    nics_per_node: int
    launch: float = 10e-6
    p2p_efficiency: float = 1.0

    @property
    def ranks(self):
        return self.nodes * self.gpus_per_node

    def net_flow(self, flows):
        """One of ``flows`` point-to-point flows leaving a node at once."""
        share = min(1.0, self.nics_per_node / max(flows, 1))
        return Link(self.nic.alpha, self.nic.beta * share * self.p2p_efficiency)

    def flat_flow(self, distance):
        """The slowest flow of a flat step at distance ``d`` (``min(d, K)`` ranks cross)."""
        k = self.gpus_per_node
        if self.nodes == 1:
            return self.intra
        net = self.net_flow(min(distance, k))
        return net if k == 1 or net.time(1 << 20) >= self.intra.time(1 << 20) else self.intra


def nccl_allreduce(c: Cluster, nbytes) -> float:
    """NCCL's pipelined ring: the slower of the NICs and the NVLink hops sets the rate."""
    n = c.ranks
    if n == 1:
        return c.launch
    if c.nodes == 1:
        return c.launch + 2 * (n - 1) * c.intra.alpha + 2 * (n - 1) / n * nbytes / c.intra.beta
    bw = min(c.intra.beta, c.nics_per_node * c.nic.beta)
    return c.launch + 2 * (n - 1) * c.nic.alpha + 2 * (n - 1) / n * nbytes / bw


def nccl_in_node(c: Cluster, nbytes) -> float:
    """NCCL's reduce-scatter (or all-gather) of ``nbytes`` per rank in one node."""
    k = c.gpus_per_node
    if k == 1:
        return 0.0
    return c.launch + (k - 1) * c.intra.alpha + (k - 1) / k * nbytes / c.intra.beta


def predict(c: Cluster, elements, rates, codec="dynamiq", bits=5.0, topologies=("ring", "butterfly"),
            host="fixed", in_bytes=2, tile_bytes=DEFAULT_TILE_BYTES, widths=None,
            gather=schedules.DEFAULT_GATHER) -> dict:
    """Seconds of NCCL's all-reduce, our flat calls and our hierarchical calls
    (``gather``: the compressed calls' all-gather schedule)."""
    nbytes = elements * in_bytes
    def cost_at(tile_elements):
        return codec_cost(codec, bits, rates, tile_elements, widths=widths, in_bytes=in_bytes)

    t_nccl = nccl_allreduce(c, nbytes)
    out = {"nccl": {"seconds": t_nccl, "speedup": 1.0}}
    for topo in topologies:
        flat_note = ""
        if topo == "butterfly" and c.ranks & (c.ranks - 1):
            flat_note = "the library refuses a butterfly over a non-power-of-two world; ring shown"
        flat = compressed_allreduce(c.ranks, elements, cost_at, c.flat_flow, rates, topo, host,
                                    tile_bytes, in_bytes, gather=gather)
        out[f"flat_{topo}"] = dict(flat, speedup=t_nccl / flat["seconds"], note=flat_note)
        if c.gpus_per_node == 1:
            lv = dict(flat, note="one GPU per node: the flat call")
        elif c.nodes == 1:
            lv = {"seconds": t_nccl, "note": "one node: NCCL's own all-reduce"}
        else:
            rs = nccl_in_node(c, nbytes)
            rail = compressed_allreduce(c.nodes, elements / c.gpus_per_node, cost_at,
                                        lambda d: c.net_flow(c.gpus_per_node), rates, topo, host,
                                        tile_bytes, in_bytes, gather=gather)
            lv = {"seconds": 2 * rs + rail["seconds"], "in_node_reduce_scatter": rs,
                  "rails": rail, "in_node_all_gather": rs, "topology": rail["topology"],
                  "note": "" if rail["topology"] == topo else
                  "butterfly over a non-power-of-two node count: the ring on the rails"}
        out[f"levels_{topo}"] = dict(lv, speedup=t_nccl / lv["seconds"])
    return out
