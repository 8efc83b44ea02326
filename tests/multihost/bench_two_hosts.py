"""Run ``hybridkv bench crosshost`` on host B against a master + storage node on host A.

``PYTHONPATH=tests scripts/netns-run .venv/bin/python tests/multihost/bench_two_hosts.py OUT.json`` (root;
``tests/`` on ``PYTHONPATH`` so the script imports ``support``). The same topology as the two-host tests;
prints the bench's table and writes its JSON report to OUT.json.
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

from support.cluster import MODELS_DIR, Cluster
from support.hosts import HostPair


def main(out: str) -> int:
    with tempfile.TemporaryDirectory(prefix="hybridkv-bench-two-hosts-") as scratch:
        cluster = Cluster(HostPair.create(), Path(scratch), MODELS_DIR, segment="1GiB")
        try:
            cluster.start_master()
            cluster.start_node()
            command = [sys.executable, "-m", "hybridkv.cli", "bench", "crosshost", "--store",
                       cluster.store_url(cluster.pair.b), "--models-dir", str(MODELS_DIR), "--out", out]  # fmt: skip
            return subprocess.call(cluster.pair.b.argv(command))
        finally:
            cluster.stop()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
