"""``hybridkv bench datapath`` through the CLI entry point on the CPU (the GPU run is documented in
docs/performance.md): every case is verified byte for byte, and each measure gets one timing per round."""

from __future__ import annotations

import json
from pathlib import Path


def test_bench_datapath_cpu_rows(tmp_path: Path, capsys: object) -> None:
    from hybridkv.cli import main

    out = tmp_path / "datapath.json"
    argv = ["bench", "datapath", "--device", "cpu", "--batches", "2,3", "--repeats", "3"]
    assert main([*argv, "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert report["env"]["device"] == "cpu" and report["beside_compute"] == []
    rows = report["rows"]
    assert [(r["geometry"], r["blocks"]) for r in rows] == [
        ("attn", 2),
        ("attn", 3),
        ("mamba", 2),
        ("mamba", 3),
    ]
    for row in rows:
        assert row["verified"] is True, row
        assert row["kernel"] == "no", row  # host caches are read in place: no staging, no kernel
        assert len(row["gather_gbps_all"]) == len(row["scatter_gbps_all"]) == 3, row
        assert 0 < row["gather_ratio"] and 0 < row["scatter_ratio"], row
        assert "gather_dma_ratio" not in row, row  # the DMA path exists on CUDA only


def test_datapath_targets_cover_each_path_from_64_blocks() -> None:
    from hybridkv.bench.datapath import datapath_targets

    rows = [
        {"geometry": "attn", "blocks": 16, "kernel": "save+load", "gather_ratio": 0.6},
        {
            "geometry": "attn",
            "blocks": 64,
            "kernel": "save+load",
            "gather_ratio": 0.86,
            "scatter_ratio": 0.84,
            "gather_dma_ratio": 0.85,
            "scatter_dma_ratio": 0.9,
        },
        {
            "geometry": "mamba",
            "blocks": 64,
            "kernel": "no: strided",
            "gather_ratio": 0.9,
            "gather_dma_ratio": 0.9,
        },
    ]
    got = {t["target"]: t["met"] for t in datapath_targets(rows)}
    assert got == {
        "attn, 64 blocks: gather by dma / copy": True,
        "attn, 64 blocks: scatter by dma / copy": True,
        "attn, 64 blocks: gather by kernel / copy": True,
        "attn, 64 blocks: scatter by kernel / copy": False,
        "mamba, 64 blocks: gather by dma / copy": True,
    }
