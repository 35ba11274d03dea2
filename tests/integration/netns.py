"""Network namespaces for tests that stand for separate hosts or a shared container namespace (root only)."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator, Sequence


def netns_usable() -> bool:
    """True when this process may create network namespaces and ``redis-server`` is installed."""
    if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("redis-server") is None:
        return False
    name = f"blprobe{os.getpid()}"
    ok = subprocess.run(["ip", "netns", "add", name], capture_output=True).returncode == 0
    if ok:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return ok


def sh(*cmd: str) -> None:
    """Run ``cmd``; ``RuntimeError`` with its stderr when it fails."""
    done = subprocess.run(list(cmd), capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise RuntimeError(f"`{' '.join(cmd)}` failed: {done.stderr.strip()}")


@contextlib.contextmanager
def connected_hosts(tag: str, addresses: Sequence[str]) -> Iterator[tuple[list[str], list[str]]]:
    """Two namespaces joined by a veth pair with ``addresses`` (/24); yields (namespaces, veths). Always removed."""
    suffix = f"{tag}{os.getpid() % 100000}"
    namespaces, veths = [f"{suffix}a", f"{suffix}b"], [f"{suffix}a", f"{suffix}b"]
    try:
        for ns in namespaces:
            sh("ip", "netns", "add", ns)
        sh("ip", "link", "add", veths[0], "type", "veth", "peer", "name", veths[1])
        for ns, veth, addr in zip(namespaces, veths, addresses, strict=True):
            sh("ip", "link", "set", veth, "netns", ns)
            sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", veth)
            sh("ip", "-n", ns, "link", "set", veth, "up")
            sh("ip", "-n", ns, "link", "set", "lo", "up")
        yield namespaces, veths
    finally:
        for ns in namespaces:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)  # also removes the veth pair
