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
    # Per-reason columns (stall_*, not the "(Not Issued)" copies), when the table has them.
    reasons = [(i, c[len("stall_"):]) for i, c in enumerate(head) if c.startswith("stall_") and "Not Issued" not in c]
    if reasons:
        print("samples by reason:")
        sums = {name: sum(number(r[i]) or 0 for r in body if len(r) > i) for i, name in reasons}
        for name, n in sorted(sums.items(), key=lambda kv: -kv[1])[:10]:
            print(f"  {name:<28} {n:9.0f} {100 * n / max(total, 1):5.1f}%")
    print(f"top {top} instructions (index in the table, samples, main reasons):")
    order = {id(r): k for k, r in enumerate(body)}
    for r in sorted((r for r in body if len(r) > samp), key=lambda r: -(number(r[samp]) or 0))[:top]:
        n = number(r[samp]) or 0
        why = sorted(((number(r[i]) or 0, name) for i, name in reasons), reverse=True)[:2]
        why_s = " ".join(f"{name} {v:.0f}" for v, name in why if v > 0)
        print(f"  #{order[id(r)]:<5} {n:8.0f} {100 * n / max(total, 1):5.1f}%  {r[src].strip()[:60]:<60} {why_s}")
    print("column totals:")
    for i, c in enumerate(head):
        vals = [number(r[i]) for r in body if len(r) > i]
        if i != src and vals and all(v is not None for v in vals):
            print(f"  {c[:60]:<60} {sum(vals):14.0f}")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 40)
