#!/usr/bin/env python3
"""Summarises Nsight Compute's per-instruction SASS table (ncu -i REP --page source --csv
--print-source sass): the instructions with the most warp-stall samples, the samples by
opcode, and the totals of every numeric column. Usage: sass-stalls.py TABLE.csv [TOP]"""
import csv
import sys
from collections import defaultdict


def number(s):
    try:
        return float(s.replace(",", ""))
    except (AttributeError, ValueError):
        return None


def main(path, top=40):
    with open(path, newline="") as f:
        rows = [r for r in csv.reader(f) if r]
    head_at = next(i for i, r in enumerate(rows) if any("Source" in c for c in r))
    head, body = rows[head_at], rows[head_at + 1:]
    src = next(i for i, c in enumerate(head) if c.strip() == "Source")
    addr = next((i for i, c in enumerate(head) if "Address" in c), None)
    samp = next(i for i, c in enumerate(head) if "Warp Stall Sampling (All" in c)
    total = sum(number(r[samp]) or 0 for r in body if len(r) > samp)
    print(f"{len(body)} instructions, {total:.0f} stall samples")
    by_op = defaultdict(float)
    for r in body:
        if len(r) > samp:
            words = r[src].split()
            op = (words[1] if words and words[0].startswith("@") and len(words) > 1 else (words or [""])[0])
            by_op[op] += number(r[samp]) or 0
    print("samples by opcode:")
    for op, n in sorted(by_op.items(), key=lambda kv: -kv[1])[:20]:
        print(f"  {op:<28} {n:9.0f} {100 * n / max(total, 1):5.1f}%")
    print(f"top {top} instructions:")
    for r in sorted((r for r in body if len(r) > samp), key=lambda r: -(number(r[samp]) or 0))[:top]:
        n = number(r[samp]) or 0
        print(f"  {r[addr] if addr is not None else '':>8} {n:8.0f} {100 * n / max(total, 1):5.1f}%  {r[src].strip()[:90]}")
    print("column totals:")
    for i, c in enumerate(head):
        vals = [number(r[i]) for r in body if len(r) > i]
        if i != src and vals and all(v is not None for v in vals):
            print(f"  {c[:60]:<60} {sum(vals):14.0f}")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 40)
