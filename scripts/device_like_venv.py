"""A fresh venv that holds only what the GPU machine's device image holds (CI's stand-in for it).

    python scripts/device_like_venv.py DIR [--packages scripts/device_image_packages.txt]

Made with the running interpreter (`venv`, with pip); every distribution of the running
environment whose name is on the device image's list (scripts/device_image_packages.txt) is linked
into DIR's site-packages (its top-level files and dist-info, from local disk, no download); nothing
else is there but what those need in the versions installed here (a newer huggingface_hub needs
httpx2; the device's own does not), never a carried one: the project's other needs (msgspec, pyzmq,
fastapi, ...: scripts/gpu_check_wheels.txt) come only as carried wheels, as on the device.
Prints DIR/bin/python.
"""
from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import sysconfig
from importlib import metadata

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def device_packages(path: str) -> set[str]:
    with open(path, encoding="utf-8") as f:
        return {normalize(line.strip()) for line in f if line.strip() and not line.startswith("#")}


def carried_packages() -> set[str]:
    with open(os.path.join(ROOT, "scripts", "gpu_check_wheels.txt"), encoding="utf-8") as f:
        return {normalize(line.split("==")[0].strip()) for line in f if line.strip() and not line.startswith("#")}


def with_needs(names: set[str], installed: dict[str, metadata.Distribution], never: set[str]) -> set[str]:
    """names and, transitively, the installed distributions they require (no extras), less `never`."""
    out, todo = set(), [n for n in names if n in installed]
    while todo:
        name = todo.pop()
        if name in out or name in never:
            continue
        out.add(name)
        for req in installed[name].requires or ():
            if "extra ==" in req:
                continue
            dep = normalize(re.split(r"[\s;<>=!~\[(]", req.strip(), maxsplit=1)[0])
            if dep in installed:
                todo.append(dep)
    return out


def top_level_entries(dist: metadata.Distribution) -> set[str]:
    """The names a distribution puts directly in site-packages (packages, modules, dist-info, .pth)."""
    out = set()
    for f in dist.files or ():
        first = f.parts[0]
        if first in ("..", "__pycache__") or first.endswith(".data"):
            continue
        out.add(first)
    return out


def build(target: str, allowed: set[str]) -> tuple[str, list[str]]:
    subprocess.run([sys.executable, "-m", "venv", target], check=True)
    py = os.path.join(target, "bin", "python")
    site = subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          check=True, capture_output=True, text=True).stdout.strip()
    source = sysconfig.get_paths()["purelib"]
    installed = {normalize(d.metadata["Name"] or ""): d for d in metadata.distributions(path=[source])}
    allowed = with_needs(allowed, installed, never=carried_packages() | {"pip"})   # NOTE: venv brings its own pip
    linked = []
    for name, dist in installed.items():
        if name not in allowed:
            continue
        for entry in top_level_entries(dist):
            src, dst = os.path.join(source, entry), os.path.join(site, entry)
            if os.path.exists(src) and not os.path.lexists(dst):
                os.symlink(src, dst)
        linked.append(name)
    return py, sorted(set(linked))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("dir")
    p.add_argument("--packages", default=os.path.join(ROOT, "scripts", "device_image_packages.txt"))
    args = p.parse_args()
    if os.path.exists(args.dir) and os.listdir(args.dir):
        p.error(f"dir: {args.dir} exists and is not empty (a fresh venv needs a fresh folder)")
    py, linked = build(args.dir, device_packages(args.packages))
    print(f"{len(linked)} distributions linked: {' '.join(linked)}", file=sys.stderr)
    print(py)
    return 0


if __name__ == "__main__":
    sys.exit(main())
