#!/usr/bin/env python3
"""How a streaming run's reads overlapped its decode step on the GPU, from a timeline that
`LEANSTREAM_GPU=1 leanstream bench --trace TRACE.json` wrote (docs/gpu.md, "Measuring").

For each run (process) of the trace: the time the flash was busy (the union of its reads), and of
that the share during which the GPU computed (attention, FFN from the neuron pool, or the head),
the share during which the host worked between GPU submissions (the engine's choice, the reads it
waited for, the uploads; or the FFN on the CPU), and the GPU's busy share of the decode.

usage: scripts/gpu-overlap.py TRACE.json
"""
import json
import sys


def union(spans):
    """Sorted, merged (start, end) intervals."""
    out = []
    for s, e in sorted(spans):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return out


def length(spans):
    return sum(e - s for s, e in spans)


def overlap(a, b):
    """Total length of the intersection of two merged interval lists."""
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        s, e = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if s < e:
            total += e - s
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    events = json.load(open(sys.argv[1]))["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}
    print("| run | flash busy ms | with the GPU computing | with the host working | GPU busy share of the decode |")
    print("|---|---|---|---|---|")
    for pid, name in sorted(names.items()):
        spans = [e for e in events if e.get("pid") == pid and e.get("ph") == "X"]
        pick = lambda cat, f=lambda e: True: union(
            (e["ts"], e["ts"] + e["dur"]) for e in spans if e["cat"] == cat and f(e))
        reads = pick("read")
        gpu = pick("gpu", lambda e: not e["name"].startswith("host"))
        host = pick("gpu", lambda e: e["name"].startswith("host"))
        decode = pick("decode")
        busy = length(reads)
        if not gpu:
            print(f"| {name} | {busy / 1e3:.1f} | (no GPU spans: was LEANSTREAM_GPU=1 set?) | | |")
            continue
        share = lambda x: f"{x / busy:.2f}" if busy else "-"
        print(f"| {name} | {busy / 1e3:.1f} | {share(overlap(reads, gpu))} | "
              f"{share(overlap(reads, host))} | {length(gpu) / max(length(decode), 1e-9):.2f} |")


if __name__ == "__main__":
    main()
