"""The metric families a Grafana dashboard's queries read (deploy/monitoring/)."""

from __future__ import annotations

import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DASHBOARD = os.path.join(ROOT, "deploy", "monitoring", "grafana", "paged-llm.json")


def queried_families(dashboard: dict) -> set[str]:
    names = set()
    for panel in dashboard["panels"]:
        for target in panel["targets"]:
            for name in re.findall(r"\b((?:vllm:|llm_|nv_)[a-z0-9_:]+)", target["expr"]):
                names.add(re.sub(r"_(bucket|sum|count)$", "", name))
    return names
