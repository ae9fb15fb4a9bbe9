#!/usr/bin/env python3
"""Run every GPU check of kvpool on a CUDA machine and write one JSON report.

Each area keeps its checks in ``scripts/gpu_check_<area>.py`` exposing
``run(report: dict) -> None``. A failing area is recorded (with its traceback)
and the others still run. Exit code 1 if any area failed or no GPU exists.

    python scripts/gpu_check.py --json OUT.json [--only transfer,tier]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import sys
import time
import traceback
from pathlib import Path

AREAS = ["transfer", "tier", "connector", "store", "mooncake", "rdma"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json", default=None, help="write the report here")
    parser.add_argument("--only", default="", help="comma-separated areas")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    report: dict = {"started": time.time(), "areas": {}}
    try:
        import torch

        report["cuda_available"] = bool(torch.cuda.is_available())
        if torch.cuda.is_available():
            report["device_name"] = torch.cuda.get_device_name(0)
    except Exception as exc:  # torch missing: the areas may still use cupy
        report["cuda_available"] = False
        report["torch_error"] = repr(exc)
    if not report["cuda_available"]:
        print("no CUDA device: nothing to check", file=sys.stderr)
        return 1
    wanted = [a for a in args.only.split(",") if a] or AREAS
    failed = False
    here = Path(__file__).resolve().parent
    for area in wanted:
        path = here / f"gpu_check_{area}.py"
        if not path.exists():
            report["areas"][area] = {"status": "missing"}
            continue
        section: dict = {}
        t0 = time.perf_counter()
        try:
            spec = importlib.util.spec_from_file_location(f"gpu_check_{area}", path)
            assert spec and spec.loader
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
            module.run(section)
            section["status"] = section.get("status", "ok")
        except Exception:
            failed = True
            section["status"] = "failed"
            section["traceback"] = traceback.format_exc()
            print(section["traceback"], file=sys.stderr)
        section["seconds"] = round(time.perf_counter() - t0, 2)
        report["areas"][area] = section
        print(f"== {area}: {section['status']} ({section['seconds']} s)", flush=True)
    text = json.dumps(report, indent=2, default=str)
    if args.json:
        Path(args.json).write_text(text)
    print(text)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
