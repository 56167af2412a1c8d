"""The live set of a compiled step's temporaries at their peak, from XLA's dumps (``xla_dump_to``):
``*-live-range.txt`` (HloLiveRange: every buffer's [start, end] in the flattened schedule) and
``*-buffer-assignment.txt`` (each value's size and its allocation). Values in entry-parameter,
constant or output allocations are left out; what remains is what ``temp_size_in_bytes`` packs.

The largest live set is what the planner's temporaries estimate counts; the temp allocation can be
larger, where XLA's heap packing leaves holes between buffers of different lifetimes (fragmentation),
which no count of live arrays reproduces.

    python experiments/live_set.py DUMP_DIR [--top 40] [--at T]
"""

from __future__ import annotations

import argparse
import pathlib
import re

VALUE = re.compile(r"value: <\d+ (\S+)(?: \(phi\))? @\d+> \(size=(\d+),offset=(\d+)\): (\S+)")


def load(dump: pathlib.Path):
    ba = max(dump.glob("*train_step*after_optimizations-buffer-assignment.txt"), default=None) or max(
        dump.glob("*after_optimizations-buffer-assignment.txt"), key=lambda p: p.stat().st_size
    )
    lr = pathlib.Path(str(ba).replace("-buffer-assignment.txt", "-live-range.txt"))
    temp_values, temp_size = {}, 0
    kind = None
    for line in ba.read_text().splitlines():
        if line.startswith("allocation "):
            kind = "temp" if "preallocated-temp" in line else "other"
            if kind == "temp":
                temp_size = int(re.search(r"size (\d+)", line).group(1))
        elif kind == "temp" and (m := VALUE.search(line)):
            name = m.group(1) if "{" in m.group(1) else m.group(1) + "{}"
            temp_values[name] = (int(m.group(2)), m.group(4), int(m.group(3)))
        elif not line.startswith(" "):
            kind = None
    ranges = {}
    text = lr.read_text()
    section = text.split("BufferLiveRange:")[1].split("Live ranges at")[0]
    for line in section.splitlines():
        m = re.match(r"\s+(\S+\{[^}]*\}):(\d+)-(\d+)", line)
        if m:
            ranges[m.group(1)] = (int(m.group(2)), int(m.group(3)))
    seq = {}
    for line in text.split("InstructionSequence:")[1].split("BufferLiveRange:")[0].splitlines():
        m = re.match(r"\s+(\d+):(\S+)", line)
        if m:
            seq[int(m.group(1))] = m.group(2)
    return temp_size, temp_values, ranges, seq


def live_sets(dump: pathlib.Path):
    """(temp allocation bytes, live bytes at each step of the schedule, ``live_at``, the schedule)."""
    temp_size, values, ranges, seq = load(dump)
    n = max(e for _, e in ranges.values()) + 1

    def live_at(t: int) -> dict[int, tuple[int, str, str]]:
        """offset -> (size, name, shape) of the values live at t; aliases of one buffer share an offset."""
        slots: dict[int, tuple[int, str, str]] = {}
        for name, (size, shape, off) in values.items():
            if name in ranges and ranges[name][0] <= t <= ranges[name][1]:
                if off not in slots or slots[off][0] < size:
                    slots[off] = (size, name, shape)
        return slots

    def union(slots: dict[int, tuple[int, str, str]]) -> int:
        total, end = 0, -1
        for off in sorted(slots):
            lo, hi = max(off, end), off + slots[off][0]
            total += max(0, hi - lo)
            end = max(end, hi)
        return total

    return temp_size, [union(live_at(t)) for t in range(n)], live_at, seq


def live_peak_bytes(dump: pathlib.Path) -> tuple[int, int]:
    """(temp allocation, largest live set) in bytes of the largest module dumped under ``dump``."""
    temp_size, curve, _, _ = live_sets(dump)
    return temp_size, max(curve)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dump")
    ap.add_argument("--top", type=int, default=40)
    ap.add_argument("--at", type=int)
    a = ap.parse_args()
    temp_size, curve, live_at, seq = live_sets(pathlib.Path(a.dump))
    n = len(curve)
    at = a.at if a.at is not None else max(range(n), key=curve.__getitem__)
    print(
        f"temp allocation {temp_size / 2**20:.2f} MiB; live temp bytes at {at} ({seq.get(at)}): "
        f"{curve[at] / 2**20:.2f} MiB (max over the schedule {max(curve) / 2**20:.2f})"
    )
    rows = sorted(live_at(at).values(), reverse=True)
    tot = 0
    for size, name, shape in rows[: a.top]:
        tot += size
        print(f"  {size / 2**20:9.3f} {tot / 2**20:9.2f}  {shape:40s} {name}")
    print(f"  ... {len(rows)} values, {sum(r[0] for r in rows) / 2**20:.2f} MiB")


if __name__ == "__main__":
    main()
