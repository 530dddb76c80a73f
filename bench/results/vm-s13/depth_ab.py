"""bench/results/vm-s12/depth_ab.py with one more engine, `cpufuse-base`: cpufuse from another tree (the
base of an A/B, e.g. main), so base, head and llama.cpp alternate in one run (session 13):

    python bench/results/vm-s13/depth_ab.py --base-tree /work/main --model PATH --text FILE --depth 4096 \\
        --types f16,q8_0 --engines cpufuse-base,cpufuse,llama.cpp --rounds 2 --core 1 --json OUT.json

Everything else is vm-s12's script (its docstring). Both cpufuse trees share one saved cache state per
type (cpufuse-TYPE-DEPTH.state): the caches they fill are the same bit for bit."""
import importlib.util
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
_spec = importlib.util.spec_from_file_location("depth_ab_s12", os.path.join(HERE, "..", "vm-s12", "depth_ab.py"))
s12 = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(s12)
_run_child = s12.run_child


def run_child(python, job, core, timeout):
    if job["engine"].startswith("cpufuse"):
        python = sys.executable
        job = dict(job, state=job["state"].replace("cpufuse-base-", "cpufuse-"), base_tree=os.environ["DEPTH_BASE_TREE"])
    s12.__file__ = os.path.abspath(__file__)      # the children run this script
    return _run_child(python, job, core, timeout)


def child(j):
    if j["engine"] == "cpufuse-base":
        s12.ROOT = j["base_tree"]                  # cpufuse_engine puts ROOT first on sys.path
        j = dict(j, engine="cpufuse")
    return s12.child(j)


if __name__ == "__main__":
    if sys.argv[1:2] == ["--child"]:
        s12.child_main(child)
    else:
        if "--base-tree" in sys.argv:
            i = sys.argv.index("--base-tree")
            os.environ["DEPTH_BASE_TREE"] = os.path.abspath(sys.argv[i + 1])
            del sys.argv[i:i + 2]
        s12.run_child = run_child
        s12.main()
