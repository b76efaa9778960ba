"""What a test's processes left behind, read from /proc (Linux): their descendants, whether they
still run, the TCP sockets they listen on and whether those very sockets (by inode) are still
open after the processes are gone."""

from __future__ import annotations

import os
from pathlib import Path


def descendants(pid: int) -> set[int]:
    """Every process below ``pid`` (children, grandchildren, ...) now."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d.name))
    out, todo = set(), [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.add(c)
            todo.append(c)
    return out


def alive(pid: int) -> bool:
    """``pid`` runs (a zombie, already exited, does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    try:
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            target = os.readlink(fd)
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    except OSError:
        pass
    return inodes


def _listen_table() -> dict[str, int]:
    """``{socket inode: port}`` of every TCP socket in LISTEN state of this network namespace."""
    out = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            f = line.split()
            if f[3] == "0A":
                out[f[9]] = int(f[1].rsplit(":", 1)[1], 16)
    return out


def listening_sockets(pids: set[int]) -> dict[str, int]:
    """``{socket inode: port}`` of the TCP sockets in LISTEN state these processes hold."""
    held = set().union(*(_socket_inodes(p) for p in pids)) if pids else set()
    return {inode: port for inode, port in _listen_table().items() if inode in held}


def still_listening(sockets: dict[str, int]) -> dict[int, list[str]]:
    """The ports of ``sockets`` whose very socket (same inode) still listens, each with the
    processes that hold it open (``"pid: command line"``). A port number that another server
    (another test's) took since is not one of them."""
    table = _listen_table()
    left = {inode: port for inode, port in sockets.items() if inode in table}
    if not left:
        return {}
    holders: dict[int, list[str]] = {port: [] for port in left.values()}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            for inode in _socket_inodes(int(d.name)) & left.keys():
                try:
                    cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
                except OSError:
                    cmd = "?"
                holders[left[inode]].append(f"{d.name}: {cmd[:200]}")
    return holders
