"""deferalloc.memory_snapshot()'s conversion: the allocator's snapshot text
(dfa_memory_snapshot, Note [Memory snapshots]) parsed and turned into PyTorch's snapshot
format (what ``torch.cuda.memory._snapshot()`` returns), for ``torch.cuda._memory_viz``
and pytorch.org/memory_viz.  docs/MEMORY.md describes what it shows.
"""
from __future__ import annotations

import ctypes
import sys

import torch

from ._native import allocator

STATES = {"a": "active_allocated", "p": "active_pending_free", "f": "inactive"}


def snapshot_text() -> str:
    """dfa_memory_snapshot's text."""
    lib = allocator()
    needed = ctypes.c_size_t()
    for _ in range(8):  # the state may grow between sizing and copying
        allocator.check(lib.dfa_memory_snapshot(None, 0, ctypes.byref(needed)), "dfa_memory_snapshot")
        buf = ctypes.create_string_buffer(needed.value + needed.value // 8 + 65536)
        st = lib.dfa_memory_snapshot(buf, len(buf), ctypes.byref(needed))
        if st == 0:
            return buf.value.decode()
        if needed.value < len(buf):
            raise allocator.error(st, "dfa_memory_snapshot")
    raise allocator.error(st, "dfa_memory_snapshot")


def parse(text: str) -> dict:
    """dfa_memory_snapshot's lines (Note [Memory snapshots]) as dicts."""
    devices, reservations = {}, []
    dev = seg = res = None
    for line in text.splitlines():
        kind, _, rest = line.partition(" ")
        if kind == "D":
            dev = devices.setdefault(int(rest), {"groups": {}, "segments": [], "paused": [], "events": []})
        elif kind == "A":
            g, limit, backed, refusals = map(int, rest.split())
            dev.update(granularity=g, limit=limit, backed=backed, refusals=refusals)
        elif kind == "G":
            idx, small, paused, keep, name = rest.split(" ", 4)
            dev["groups"][int(idx)] = {"name": name, "small": small == "1", "paused": paused == "1",
                                       "keep": "host" if keep == "1" else "discard", "tag": int(idx) >= 2}
        elif kind == "S":
            gi, rid, base, size = map(int, rest.split())
            seg = {"group": gi, "id": rid, "base": base, "size": size, "runs": [], "blocks": []}
            res = None
            dev["segments"].append(seg)
        elif kind == "R":
            off, length = map(int, rest.split())
            (res if res is not None else seg)["runs"].append((off, length))
        elif kind == "B":
            a, size, req, state, stream, resident = rest.split()
            seg["blocks"].append((int(a), int(size), int(req), state, int(stream), resident == "1"))
        elif kind == "P":
            gi, a, length = map(int, rest.split())
            dev["paused"].append((gi, a, length))
        elif kind == "E":
            action, a, size, stream, t_us, gi, aux = rest.split()
            dev["events"].append((action, int(a), int(size), int(stream), int(t_us), int(gi), int(aux)))
        elif kind == "Q":
            rid, a, reserved, backed, backup = map(int, rest.split())
            res = {"id": rid, "address": a, "reserved_bytes": reserved, "backed_bytes": backed,
                   "backup_bytes": backup, "runs": []}
            reservations.append(res)
    return {"devices": devices, "reservations": reservations}


def torch_segment(device: int, address: int, blocks: list, segment_type: str, pool_id, tag) -> dict:
    total = sum(b["size"] for b in blocks)
    active = [b for b in blocks if b["state"] != "inactive"]
    return {"device": device, "address": address, "total_size": total, "stream": 0,
            "segment_type": segment_type, "segment_pool_id": pool_id, "is_expandable": True, "frames": [],
            "allocated_size": sum(b["size"] for b in blocks if b["state"] == "active_allocated"),
            "active_size": sum(b["size"] for b in active),
            "requested_size": sum(b["requested_size"] for b in active),
            "deferalloc_tag": tag, "blocks": blocks}


def segments_of(device: int, dev: dict, skip_active: bool) -> list:
    """One PyTorch segment per backed run of deferalloc's segments (as PyTorch shows an
    expandable segment by its mapped ranges), its blocks clipped to the run.  With
    skip_active, only the free parts, one segment each (PyTorch's MemPools show the rest)."""
    out = []
    for seg in dev["segments"]:
        grp = dev["groups"][seg["group"]]
        tag = grp["name"] if grp["tag"] else None
        pool_id = (1, seg["group"]) if tag else (0, 0)
        kind = "small" if grp["small"] else "large"
        for off, length in seg["runs"]:
            lo, hi = seg["base"] + off, seg["base"] + off + length
            blocks = []
            for a, size, req, state, _stream, _resident in seg["blocks"]:
                s, e = max(a, lo), min(a + size, hi)
                if s >= e:
                    continue
                st = STATES[state]
                clipped = (s, e) != (a, a + size)
                blocks.append({"address": s, "size": e - s, "state": st, "frames": [],
                               "requested_size": e - s if st == "inactive" or clipped else min(req, e - s)})
            if skip_active:
                for b in blocks:
                    if b["state"] == "inactive":
                        out.append(torch_segment(device, b["address"], [b], "deferalloc_cache", pool_id, tag))
            elif blocks:
                out.append(torch_segment(device, lo, blocks, kind, pool_id, tag))
    return out


def trace_of(dev: dict) -> list:
    out = []
    for action, a, size, stream, t_us, gi, aux in dev["events"]:
        e = {"action": action, "addr": a, "size": size, "stream": stream, "time_us": t_us, "frames": []}
        if gi >= 0 and gi in dev["groups"] and dev["groups"][gi]["tag"]:
            e["deferalloc_tag"] = dev["groups"][gi]["name"]
        if action == "oom":
            e["device_free"] = aux
        out.append(e)
    return out


def annotations(parsed: dict, installed: bool, driver: str) -> dict:
    tags, devices = {}, {}
    for d, dev in parsed["devices"].items():
        devices[d] = {k: dev[k] for k in ("granularity", "limit", "backed", "refusals")}
        for gi, grp in dev["groups"].items():
            if not grp["tag"]:
                continue
            t = tags.setdefault(grp["name"], {"paused": False, "keep": grp["keep"], "paused_ranges": [],
                                               "allocated_blocks": 0, "allocated_bytes": 0, "backed_bytes": 0})
            t["paused"] |= grp["paused"]
            t["paused_ranges"] += [(d, a, n) for g2, a, n in dev["paused"] if g2 == gi]
            for seg in dev["segments"]:
                if seg["group"] != gi:
                    continue
                t["backed_bytes"] += sum(n for _, n in seg["runs"])
                for _a, size, _r, state, _s, _res in seg["blocks"]:
                    if state == "a":
                        t["allocated_blocks"] += 1
                        t["allocated_bytes"] += size
    deferred = []
    for r in parsed["reservations"]:
        backed = [(r["address"] + o, n) for o, n in r["runs"]]
        deferred.append({**{k: r[k] for k in ("id", "address", "reserved_bytes", "backed_bytes", "backup_bytes")},
                         "backed_ranges": backed})
    optimizers = []
    optim = sys.modules.get(__package__ + ".optim")  # only where the optimizer face was imported
    for o in (optim.live_optimizers() if optim is not None else ()):
        try:
            optimizers.append({"stats": o.stats(), "repr": repr(o)[:200]})
        except Exception as e:  # a closed optimizer: say so rather than fail the snapshot
            optimizers.append({"error": str(e)})
    return {"tags": tags, "deferred": deferred, "devices": devices, "optimizers": optimizers,
            "installed": installed, "driver": driver}


def build(installed: bool, driver: str) -> dict:
    """The snapshot (``deferalloc.memory_snapshot()``'s value); ``installed``: deferalloc's
    allocator serves the process (else PyTorch's own snapshot is annotated)."""
    parsed = parse(snapshot_text())
    torch_view = not installed and torch.cuda.is_available() and torch.cuda.is_initialized()
    if torch_view:
        snap = torch.cuda.memory._snapshot()
        owner = {}
        for d, dev in parsed["devices"].items():
            for seg in dev["segments"]:
                grp = dev["groups"][seg["group"]]
                for a, size, _r, state, _s, _res in seg["blocks"]:
                    if state != "f" and grp["tag"]:
                        owner[a] = grp["name"]
        for s in snap["segments"]:
            s["deferalloc_tag"] = owner.get(s["address"])
        for d, dev in parsed["devices"].items():
            snap["segments"] += segments_of(d, dev, skip_active=True)
    else:
        snap = {"segments": [], "device_traces": [], "allocator_settings": {}}
        for d, dev in sorted(parsed["devices"].items()):
            snap["segments"] += segments_of(d, dev, skip_active=False)
            while len(snap["device_traces"]) <= d:
                snap["device_traces"].append([])
            snap["device_traces"][d] = trace_of(dev)
    first = min(parsed["devices"], default=0)
    for r in parsed["reservations"]:
        for o, n in r["runs"]:
            b = {"address": r["address"] + o, "size": n, "requested_size": n, "state": "active_allocated",
                 "frames": []}
            snap["segments"].append(torch_segment(first, b["address"], [b], "deferred", (2, r["id"]), None))
    if not snap["device_traces"]:
        snap["device_traces"] = [[]]
    snap["deferalloc"] = annotations(parsed, installed, driver)
    return snap
