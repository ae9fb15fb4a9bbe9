#!/usr/bin/env python
"""Write configs/master.yaml, configs/client.yaml and docs/vllm.md's key tables
from the config dataclasses.

Every key, its help text and its default come from the dataclass fields
(kvpool.core.config.setting); run this after adding or changing a setting.
In docs/vllm.md only the lines between each table's ``config_docs`` markers
are rewritten.
``--check`` writes nothing and exits 1 when a file is stale (what
tests/core/test_config_docs.py checks).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvpool.connector.config import ConnectorConfig
from kvpool.connector.tier_config import OffloadTierConfig
from kvpool.core.config_docs import render_markdown_table, render_yaml
from kvpool.master.config import MasterConfig
from kvpool.store.config import ClientConfig

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"
VLLM_DOC = ROOT / "docs" / "vllm.md"
END = "<!-- config_docs: end -->\n"
# docs/vllm.md's tables: the key tables of the connector and of the offloading tier
VLLM_TABLES: tuple[type, ...] = (ConnectorConfig, OffloadTierConfig)

DOCS: dict[str, tuple[type, str]] = {
    "master.yaml": (MasterConfig, """\
kvpool master configuration: every key with its default (generated from
kvpool.master.config.MasterConfig by scripts/config_docs.py).
Use: kvpool master --config configs/master.yaml; each key is also a flag
(--key-name; nested: --tiering-key-name, --curve-*) that overrides the file.
Sizes accept 4GiB, 512MiB, 1GB or plain bytes."""),
    "client.yaml": (ClientConfig, """\
kvpool store client / node daemon configuration: every key with its default
(generated from kvpool.store.config.ClientConfig by scripts/config_docs.py).
Use: kvpool client --config configs/client.yaml; flags (kvpool client --help)
override the file. Sizes accept 4GiB, 512MiB, 1GB or plain bytes."""),
}


def rendered() -> dict[Path, str]:
    """The text each generated file should hold."""
    out = {CONFIGS / name: render_yaml(cls, header) for name, (cls, header) in DOCS.items()}
    doc = VLLM_DOC.read_text()
    for cls in VLLM_TABLES:
        begin = f"<!-- config_docs: {cls.__name__} (python scripts/config_docs.py) -->\n"
        head, rest = doc.split(begin, 1)
        tail = rest.split(END, 1)[1]
        doc = head + begin + render_markdown_table(cls) + END + tail
    out[VLLM_DOC] = doc
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if a file is stale")
    args = ap.parse_args()
    stale = [p for p, text in rendered().items() if not p.exists() or p.read_text() != text]
    if args.check:
        for p in stale:
            print(f"stale: {p} (run python scripts/config_docs.py)", file=sys.stderr)
        return 1 if stale else 0
    for p in stale:
        p.write_text(rendered()[p])
        print(f"wrote {p}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
