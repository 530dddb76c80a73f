"""The tests stand alone: no test imports the benchmark (bench/) or runs one of its modules; the
references they check against live in cpufuse/reference/."""
import os
import re

HERE = os.path.dirname(os.path.abspath(__file__))
USE = re.compile(r"^\s*(from|import)\s+bench\b|[\"']-m[\"'],\s*[\"']bench\.|\bimportlib\.import_module\([\"']bench\b", re.M)


def bench_uses(text):
    return [m.group(0).strip() for m in USE.finditer(text)]


def test_the_scan_sees_an_import():
    b = "bench"   # spelled apart, so this file does not match itself
    assert bench_uses(f"import numpy\nfrom {b} import run\n") == [f"from {b}"]
    assert bench_uses(f"  import {b}.e2e.big as big\n") == [f"import {b}"]
    assert bench_uses(f'subprocess.run([sys.executable, "-m", "{b}.e2e.load"])') == [f'"-m", "{b}.']
    assert bench_uses("# the bench writes them\nfrom cpufuse import reference\n") == []


def test_no_test_imports_bench():
    found = {}
    for root, _, files in os.walk(HERE):
        for f in files:
            if f.endswith(".py"):
                with open(os.path.join(root, f), encoding="utf-8") as fh:
                    uses = bench_uses(fh.read())
                if uses:
                    found[os.path.relpath(os.path.join(root, f), HERE)] = uses
    assert found == {}
