"""``gdsload cache ls|clear [CACHE_DIR] [URL]``: the versions of remote datasets a node's cache folder holds,
and the removal of those no dataset has open (:mod:`gdsload.remote.cache_folder`)."""

from __future__ import annotations

import argparse
import os

from .._units import human_bytes
from ..remote.cache_folder import Cached, clear, versions


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The command's arguments (``gdsload cache --help``)."""
    p.add_argument("action", choices=["ls", "clear"], help="ls: list the versions; clear: remove those no dataset "
                                                           "has open (and unfinished fetches), saying what it removed")
    p.add_argument("cache_dir", nargs="?", default=None, metavar="CACHE_DIR",
                   help="the cache_dir datasets were opened with (default: 'datasets' in gdsload's cache folder, "
                        "where GDSDataset puts them without one)")
    p.add_argument("url", nargs="?", default=None, metavar="URL", help="clear: only the versions of this URL")


def main(args: argparse.Namespace) -> int:
    from ..system.env import cache_dir as env_cache_dir

    folder = args.cache_dir or os.path.join(env_cache_dir(), "datasets")
    if args.action == "ls":
        if args.url is not None:
            raise ValueError("URL is for 'gdsload cache clear' (ls lists every version)")
        found = versions(folder)
        for c in found:
            print(_line(c))
        total = sum(c.disk_bytes for c in found)
        print(f"{folder}: {len(found)} folder(s), {human_bytes(total)} on disk" if found else f"{folder}: no versions")
        return 0
    removed, kept = clear(folder, args.url)
    for c in removed:
        print(f"removed {_line(c)}")
    for c in kept:
        print(f"kept {_line(c)}")
    freed = sum(c.disk_bytes for c in removed)
    print(f"{folder}: removed {len(removed)} folder(s) ({human_bytes(freed)}); kept {len(kept)} in use")
    return 0


def _line(c: Cached) -> str:
    what = {"version": "version", "unfinished": "unfinished fetch", "stale": "older or damaged version"}[c.kind]
    shards = f"{c.present}/{c.shards} shards with data" if c.kind == "version" else "no shards served"
    return (f"{c.url}  {what} {c.ident}  {human_bytes(c.disk_bytes)}  {shards}  "
            f"{'in use' if c.in_use else 'not in use'}  ({c.root})")

