"""What /proc says of a process: its memory (PSS, RSS, anonymous), its mappings of a file, its threads and their
CPU time."""

import os
from pathlib import Path


def memory_of(pids: list[int]) -> dict:
    """Sum the PSS and RSS of processes from /proc/PID/smaps_rollup."""
    totals = {"pss": 0, "rss": 0, "processes": 0}
    for pid in pids:
        with open(f"/proc/{pid}/smaps_rollup") as file:
            for line in file:
                key, _, rest = line.partition(":")
                if key in ("Pss", "Rss"):
                    totals[key.lower()] += int(rest.split()[0]) * 1024
        totals["processes"] += 1
    return totals


def anonymous_megabytes(pid: int | str = "self") -> float:
    """Return a process's anonymous memory in MB (this process's by default)."""
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Anonymous:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no Anonymous line for {pid}")


def file_mappings(path) -> list[tuple[int, int, str]]:
    """Return this process's memory mappings of a file: (start, end, permissions)."""
    mappings = []
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split()
            if len(fields) == 6 and fields[5] == str(path):
                start, end = (int(address, 16) for address in fields[0].split("-"))
                mappings.append((start, end, fields[1]))
    return mappings


def mapping_rss_kb(address: int) -> int:
    """Return the kB of the memory mapping holding an address that this process has in memory (its Rss)."""
    with open("/proc/self/smaps") as smaps:
        inside = False
        for line in smaps:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                low, high = (int(bound, 16) for bound in head.split("-"))
                inside = low <= address < high
            elif inside and head == "Rss:":
                return int(line.split()[1])
    raise AssertionError(f"no mapping holds {address:#x}")


def threads_of(pid: int) -> list[int]:
    """Return the thread ids of a process."""
    return [int(tid) for tid in os.listdir(f"/proc/{pid}/task")]


def cpu_ticks_by_thread(pid: int) -> dict[int, int]:
    """Return each thread's user plus system CPU time, in clock ticks."""
    ticks = {}
    for tid in threads_of(pid):
        try:
            fields = Path(f"/proc/{pid}/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
        except FileNotFoundError:
            continue  # the thread ended meanwhile
        ticks[tid] = int(fields[11]) + int(fields[12])
    return ticks
