"""The tests marked ``gpu`` (``python -m pytest -m gpu``), as a part of ``bench/gpu_suite.py``: a GPU session's
first check, with its outcome kept beside the benchmarks'.

    python bench/gpu_tests.py --out runs/suite/gpu-tests      # ~2.5 minutes on one H100 (26 tests, 2026-11-27)
    python bench/gpu_tests.py --out /tmp/gt --smoke           # the same collection on a CPU: every test skips

Writes ``<out>/junit.xml`` (pytest's) and ``<out>/gpu_tests.json``: the counts by outcome, the failures'
names and the seconds taken; exits with pytest's status.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def outcomes(junit: Path) -> dict:
    """Counts by outcome and the names of the failed tests, from pytest's JUnit XML."""
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    failed = []
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        if case.find("failure") is not None or case.find("error") is not None:
            counts["failed"] += 1
            failed.append(name)
        elif case.find("skipped") is not None:
            counts["skipped"] += 1
        else:
            counts["passed"] += 1
    return {**counts, "failed_tests": failed}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="bench_out/gpu-tests")
    p.add_argument("--smoke", action="store_true", help="no difference: without a GPU every test skips")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    junit = out / "junit.xml"
    t0 = time.monotonic()
    rc = subprocess.run([sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider",
                         f"--junitxml={junit}"], cwd=ROOT).returncode
    summary = {"rc": rc, "seconds": round(time.monotonic() - t0, 1), **(outcomes(junit) if junit.exists() else {})}
    (out / "gpu_tests.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary))
    sys.exit(rc)


if __name__ == "__main__":
    main()
