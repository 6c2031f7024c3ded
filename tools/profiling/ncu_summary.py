"""Summarise the ncu-kernels stage's CSV (tools/device/kernels.sh): instructions per element and what
limits each profiled kernel."""
import csv
import os
import sys
from collections import OrderedDict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ncu_workload import LAUNCHES, LOG2N  # noqa: E402


def main(path):
    rows = list(csv.reader(open(path)))
    head = None
    data = OrderedDict()
    for r in rows:
        if r and r[0] == "ID":
            head = r
            continue
        if head is None or len(r) != len(head):
            continue
        d = dict(zip(head, r))
        data.setdefault(d["ID"], {"name": d["Kernel Name"]})[d["Metric Name"]] = d["Metric Value"]
    n = 1 << LOG2N
    # the workload launches an extra (unprofiled-label) compress before each non-compress op
    labels = []
    for label, w, corr, op, variant in LAUNCHES:
        if op not in ("compress", "stats"):
            labels.append("(setup compress)")
        labels.append(label)
    def f(v):
        try:
            return float(v.replace(",", ""))
        except Exception:
            return float("nan")
    print(f"ncu, 2^{LOG2N} BF16 elements; inst/elem = warp instructions x 32 / elements "
          f"(= thread instructions per element, all lanes active)")
    print(f"{'launch':<38s} {'warp-inst/elem':>14s} {'thr-inst/elem':>13s} {'time us':>8s} "
          f"{'DRAM GB/s':>9s} {'issue%':>7s} {'alu%':>6s} {'fma%':>6s} {'fmaH%':>6s} {'xu%':>6s} {'lsu%':>6s} "
          f"{'smem wf/elem':>12s} {'regs':>5s}")
    for (kid, d), label in zip(data.items(), labels + ["?"] * len(data)):
        wi = f(d.get("smsp__inst_executed.sum", "nan"))
        ti = f(d.get("smsp__thread_inst_executed.sum", "nan"))
        t_ns = f(d.get("gpu__time_duration.sum", "nan"))
        rd = f(d.get("dram__bytes_read.sum", "nan")); wr = f(d.get("dram__bytes_write.sum", "nan"))
        gbps = (rd + wr) / t_ns if t_ns == t_ns else float("nan")
        print(f"{label:<38s} {wi * 32 / n:14.1f} {ti / n:13.1f} {t_ns / 1e3:8.1f} {gbps:9.1f} "
              f"{f(d.get('smsp__issue_active.avg.pct_of_peak_sustained_active', 'nan')):7.1f} "
              f"{f(d.get('sm__inst_executed_pipe_alu.avg.pct_of_peak_sustained_active', 'nan')):6.1f} "
              f"{f(d.get('sm__inst_executed_pipe_fma.avg.pct_of_peak_sustained_active', 'nan')):6.1f} "
              f"{f(d.get('sm__inst_executed_pipe_fmaheavy.avg.pct_of_peak_sustained_active', 'nan')):6.1f} "
              f"{f(d.get('sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active', 'nan')):6.1f} "
              f"{f(d.get('sm__inst_executed_pipe_lsu.avg.pct_of_peak_sustained_active', 'nan')):6.1f} "
              f"{f(d.get('l1tex__data_pipe_lsu_wavefronts_mem_shared.sum', 'nan')) / n:12.3f} "
              f"{d.get('launch__registers_per_thread', '?'):>5s}")
    kinds = ("short_scoreboard", "long_scoreboard", "mio_throttle", "math_pipe_throttle", "wait",
             "not_selected", "selected", "no_instruction", "lg_throttle", "branch_resolving",
             "dispatch_stall")
    print("warp stall reasons, % of the listed total (smsp__average_warp_latency_issue_stalled_*):")
    print(f"  {'launch':<38s} " + " ".join(f"{k[:9]:>9s}" for k in kinds) + "  warps/SMSP  SM GHz")
    for (kid, d), label in zip(data.items(), labels + ["?"] * len(data)):
        if label.startswith("("):
            continue
        vals = [f(d.get('smsp__average_warp_latency_issue_stalled_' + k + '.ratio', 'nan')) for k in kinds]
        tot = sum(v for v in vals if v == v) or 1.0
        print(f"  {label:<38s} " + " ".join(f"{100 * v / tot:9.1f}" for v in vals) +
              f"  {f(d.get('smsp__warps_active.avg.per_cycle_active', 'nan')):10.1f}"
              f"  {f(d.get('sm__cycles_elapsed.avg.per_second', 'nan')) / 1e9:6.2f}")


if __name__ == "__main__":
    main(sys.argv[1])
