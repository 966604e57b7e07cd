"""Memory figures Linux gives in /proc ("Key:   N kB" lines): the KV pool's default size (engine/pool.py) and
the runtime a memory_limit counts (weights/expert_stream.py)."""
from __future__ import annotations


def proc_bytes(path: str, key: str) -> int | None:
    """The `key` field of a /proc file such as /proc/meminfo or /proc/self/status, in bytes; None where the
    file or the field is missing (not Linux)."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None
