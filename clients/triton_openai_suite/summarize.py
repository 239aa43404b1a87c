"""Summarize a junit.xml of Triton's OpenAI-frontend tests run against our server.

Each failed/errored test is matched against classification.py (regexes on
"file::Class::test[params]"); anything unmatched is listed as UNCLASSIFIED (new!)."""
import argparse
import re
import xml.etree.ElementTree as ET
from collections import Counter

from classification import RULES


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("junit")
    ap.add_argument("--meta", nargs="*", default=[])
    args = ap.parse_args()
    root = ET.parse(args.junit).getroot()
    rows = []
    for tc in root.iter("testcase"):
        classname = tc.get("classname", "")
        parts = classname.split(".")
        # "tests.test_x.TestY" -> test_x.py::TestY
        mod = next((p for p in parts if p.startswith("test_")), parts[-1])
        cls = parts[-1] if parts[-1] != mod else ""
        nodeid = f"{mod}.py::" + (f"{cls}::" if cls else "") + tc.get("name", "")
        if not classname:  # a module that failed to import: name is "tests.test_x"
            nodeid = tc.get("name", "").split(".")[-1] + ".py (collection)"
        outcome, msg = "passed", ""
        for tag in ("failure", "error", "skipped"):
            el = tc.find(tag)
            if el is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                msg = (el.get("message") or "").splitlines()[0][:200] if el.get("message") else ""
                if tag == "skipped" and el.get("type") == "pytest.xfail":
                    outcome = "xfailed"
                break
        rows.append((nodeid, outcome, msg))
    counts = Counter(o for _, o, _ in rows)
    print("# Triton OpenAI-frontend suite against our server\n")
    for m in args.meta:
        k, _, v = m.partition("=")
        print(f"- {k}: {v}")
    print(f"- total: {len(rows)}; " + ", ".join(f"{k}: {v}" for k, v in sorted(counts.items())))
    bad = [(n, o, m) for n, o, m in rows if o in ("failed", "error")]
    cats = Counter()
    lines = []
    for n, o, m in bad:
        for pat, cat, reason in RULES:
            if re.search(pat, n):
                break
        else:
            cat, reason = "UNCLASSIFIED", "new failure: look at pytest.log"
        cats[cat] += 1
        lines.append(f"| `{n}` | {o} | {cat} | {reason} |")
    print("- failures+errors by class: " + ", ".join(f"{k}: {v}" for k, v in sorted(cats.items())))
    print("\n| test | outcome | class | reason |\n|---|---|---|---|")
    print("\n".join(lines))
    print("\n<details><summary>all outcomes</summary>\n")
    for n, o, m in rows:
        print(f"- {o}: `{n}`" + (f" — {m}" if m and o != "passed" else ""))
    print("\n</details>")


if __name__ == "__main__":
    main()
