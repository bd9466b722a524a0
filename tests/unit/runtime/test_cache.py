"""Disk kernel cache: hits, key sensitivity, corruption and truncation, concurrent processes."""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os

import pytest

from powerfusion import options
from powerfusion.cli import cmd_cache as cli_cache
from powerfusion.runtime.cache import KernelCache, canonical_key, default_cache_dir, source_hash

KEY = {"source": source_hash("__global__ void k() {}"), "arch": "sm_90", "compiler": "nvrtc-13.0",
       "options": ["-std=c++17"]}


class CountingBuild:
    def __init__(self, payload: bytes):
        self.payload, self.calls = payload, 0

    def __call__(self) -> bytes:
        self.calls += 1
        return self.payload


def test_second_lookup_is_a_hit(tmp_path):
    cache = KernelCache(tmp_path)
    build = CountingBuild(b"\x7fELF cubin bytes")
    assert cache.get_or_build(KEY, build) == b"\x7fELF cubin bytes"
    assert cache.get_or_build(KEY, build) == b"\x7fELF cubin bytes"
    assert build.calls == 1
    assert (cache.stats.hits, cache.stats.misses) == (1, 1)
    # a fresh object (another process, later) finds it on disk
    again = KernelCache(tmp_path)
    assert again.get_or_build(KEY, CountingBuild(b"other")) == b"\x7fELF cubin bytes"


@pytest.mark.parametrize("field,value", [("arch", "sm_80"), ("compiler", "nvrtc-12.8"),
                                         ("options", ["-std=c++17", "--use_fast_math"]),
                                         ("source", source_hash("x"))])
def test_every_key_part_matters(tmp_path, field, value):
    cache = KernelCache(tmp_path)
    cache.get_or_build(KEY, CountingBuild(b"first"))
    other = CountingBuild(b"second")
    assert cache.get_or_build({**KEY, field: value}, other) == b"second"
    assert other.calls == 1


def test_key_is_order_independent_and_rejects_non_json():
    assert canonical_key({"a": 1, "b": [1, 2]}) == canonical_key({"b": (1, 2), "a": 1})
    with pytest.raises(TypeError):
        canonical_key({"a": object()})


def _entry(cache: KernelCache):
    (path,) = list(cache.root.glob("??/*.pfk"))
    return path


@pytest.mark.parametrize("damage", ["flip_payload", "truncate", "empty", "garbage_header"])
def test_corrupted_entry_is_detected_and_rebuilt(tmp_path, damage):
    cache = KernelCache(tmp_path)
    cache.get_or_build(KEY, CountingBuild(b"A" * 1000))
    path = _entry(cache)
    blob = bytearray(path.read_bytes())
    if damage == "flip_payload":
        blob[-10] ^= 0xFF
    elif damage == "truncate":
        blob = blob[:-100]
    elif damage == "empty":
        blob = bytearray()
    else:
        blob[:8] = b"XXXXXXXX"
    path.write_bytes(bytes(blob))
    rebuild = CountingBuild(b"A" * 1000)
    fresh = KernelCache(tmp_path)
    assert fresh.get_or_build(KEY, rebuild) == b"A" * 1000
    assert rebuild.calls == 1 and fresh.stats.corrupt == 1
    assert KernelCache(tmp_path).lookup(KEY) == b"A" * 1000  # the rebuilt entry is sound


def test_build_must_return_bytes(tmp_path):
    with pytest.raises(TypeError):
        KernelCache(tmp_path).get_or_build(KEY, lambda: "text")
    assert KernelCache(tmp_path).status()["entries"] == 0


def test_status_and_clear(tmp_path):
    cache = KernelCache(tmp_path)
    assert cache.status() == {"path": str(tmp_path), "entries": 0, "bytes": 0}
    for i in range(3):
        cache.get_or_build({**KEY, "n": i}, CountingBuild(bytes(100 * (i + 1))))
    info = cache.status()
    assert info["entries"] == 3 and info["bytes"] > 600
    (tmp_path / "unrelated.txt").write_text("kept")
    assert cache.clear() == (3, [])
    assert cache.status()["entries"] == 0
    assert (tmp_path / "unrelated.txt").exists()


def test_default_location_follows_options(tmp_path):
    with options.context(cache_dir=tmp_path / "pf"):
        assert default_cache_dir() == tmp_path / "pf" / "kernels"
        assert KernelCache().root == tmp_path / "pf" / "kernels"


def test_cli_status_and_clear(tmp_path, capsys):
    KernelCache(tmp_path).get_or_build(KEY, CountingBuild(b"x" * 10))
    parser = argparse.ArgumentParser(prog="powerfusion")
    cli_cache.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["cache", "--dir", str(tmp_path), "status"])
    assert args.func(args) == 0
    assert "entries: 1" in capsys.readouterr().out
    args = parser.parse_args(["cache", "--dir", str(tmp_path), "clear"])
    assert args.func(args) == 0
    assert "removed 1" in capsys.readouterr().out
    assert KernelCache(tmp_path).status()["entries"] == 0


def _worker(root, key, counter_path, barrier, results):
    def build():
        with open(counter_path, "a") as f:  # O_APPEND: one line per real build
            f.write(f"{os.getpid()}\n")
        return b"".join(i.to_bytes(4, "little") for i in range(50_000))  # 200 kB, not written in one go
    barrier.wait()
    out = KernelCache(root).get_or_build(key, build)
    results.put(len(out) == 200_000 and out[-4:] == (49_999).to_bytes(4, "little"))


def test_concurrent_processes_build_once_and_never_see_partial_entries(tmp_path):
    ctx = mp.get_context("fork")
    nproc = 6
    barrier, results = ctx.Barrier(nproc), ctx.Queue()
    counter = tmp_path / "builds.txt"
    procs = [ctx.Process(target=_worker, args=(tmp_path / "cache", KEY, counter, barrier, results))
             for _ in range(nproc)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
    assert all(p.exitcode == 0 for p in procs)
    assert all(results.get(timeout=5) for _ in range(nproc))
    assert len(counter.read_text().splitlines()) == 1  # the per-key lock serialised the build
    assert KernelCache(tmp_path / "cache").status()["entries"] == 1
    assert not list((tmp_path / "cache").glob("??/.tmp-*"))
