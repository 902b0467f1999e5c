"""What authenticating checkpoints costs, per GiB (issue 27).

    python -m bench.checkpoint_mac            1 GiB, 3 repetitions
    python -m bench.checkpoint_mac --gb 0.5 --reps 5

Each figure is the median of the repetitions, through rally's own code where rally does it:

- **sums**: one pass over the bytes in 8 MiB chunks: the CRC-32 alone (the legacy footer's), the
  CRC-32 plus an HMAC-SHA256 on one thread (the first signed format, for comparison), a keyed
  BLAKE2b on one thread (the alternative considered), and rally's digest + MAC
  (``checkpoint_file.Sums``: SHA-256 leaves on agent/checkpoint/core/digest.py's threads, what
  ``job.save`` and the holder's persister compute);
- **persist**: the holder's persister writing a slot (a memfd) to a signed file in a temporary
  directory (``persist.persist``: copy, digest, fsync, rename), in the background of training;
- **verify**: ``checkpoint_file.open_mapped_verified`` of that file (what ``load_latest`` does
  before a disk load) against the same bytes with the legacy footer (CRC only).

Reloads from memory verify nothing (the holder's channel is authenticated), and the training
step's stall never computes a MAC: those are bench/checkpoint.py's figures.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import os
import statistics
import tempfile
import time
import zlib
from pathlib import Path

from rally.agent.checkpoint import persist
from rally.agent.checkpoint.core import checkpoint_file, digest

CHUNK = checkpoint_file.READ_CHUNK


def timed(action) -> float:  # type: ignore[no-untyped-def]
    started = time.perf_counter()
    action()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gb", type=float, default=1.0)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    size = int(args.gb * (1 << 30))
    data = os.urandom(1 << 20) * (size >> 20)
    view = memoryview(data)

    def crc_only() -> None:
        crc = 0
        for start in range(0, len(data), CHUNK):
            crc = zlib.crc32(view[start : start + CHUNK], crc)

    def crc_and_hmac() -> None:
        crc, mac = 0, hmac.new(b"k" * 32, b"", hashlib.sha256)
        for start in range(0, len(data), CHUNK):
            crc = zlib.crc32(view[start : start + CHUNK], crc)
            mac.update(view[start : start + CHUNK])
        mac.digest()

    def keyed_blake2b() -> None:
        mac = hashlib.blake2b(key=b"k" * 32, digest_size=32)
        for start in range(0, len(data), CHUNK):
            mac.update(view[start : start + CHUNK])
        mac.digest()

    def rally_sums() -> None:
        sums = checkpoint_file.Sums(1)
        for start in range(0, len(data), CHUNK):
            sums.update(view[start : start + CHUNK])
        sums.footer()

    rows: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory(prefix="rally-mac-") as tmp:
        directory = Path(tmp)
        slot = os.memfd_create("bench-slot")
        os.write(slot, data)
        legacy = directory / "legacy" / "step_000000000001.pt"
        legacy.parent.mkdir(mode=0o700)
        footer = checkpoint_file.LEGACY_FOOTER.pack(b"RALLYCKP", len(data), zlib.crc32(data), b"END1")
        legacy.write_bytes(data + footer)
        signed = directory / persist.default_name(1)
        for _ in range(args.reps):
            rows.setdefault("sums: CRC-32 only (legacy footer)", []).append(timed(crc_only))
            rows.setdefault("sums: CRC-32 + HMAC-SHA256, one thread (first signed format)", []).append(
                timed(crc_and_hmac)
            )
            rows.setdefault("sums: keyed BLAKE2b, one thread", []).append(timed(keyed_blake2b))
            rows.setdefault(f"sums: rally's digest + MAC ({digest.THREADS} threads)", []).append(timed(rally_sums))
            rows.setdefault("persist (signed, fsync)", []).append(
                timed(lambda: persist.persist(slot, len(data), directory, 1, 3))
            )
            rows.setdefault("verify: legacy file (CRC only)", []).append(
                timed(lambda: os.close(checkpoint_file.open_mapped_verified(legacy)[0]))
            )
            rows.setdefault("verify: signed file (digest + MAC)", []).append(
                timed(lambda: os.close(checkpoint_file.open_mapped_verified(signed)[0]))
            )
        os.close(slot)
    gb = len(data) / (1 << 30)
    print(f"{len(data) / 1e9:.2f} GB, median of {args.reps}; load average {os.getloadavg()[0]:.1f}")
    print("| what | seconds per GiB | GiB/s |\n|---|---|---|")
    for name, times in rows.items():
        per = statistics.median(times) / gb
        print(f"| {name} | {per:.3f} | {1 / per:.2f} |")


if __name__ == "__main__":
    main()
