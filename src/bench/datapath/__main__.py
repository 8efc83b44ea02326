"""``python -m hybridkv.bench.datapath``: the data-path bench on a host with only torch and numpy."""

from __future__ import annotations

import sys

from hybridkv.bench.datapath.cli import main

sys.exit(main())
