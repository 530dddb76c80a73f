"""Op graphs: build nodes (builder), fuse them into steps (fusion), lower the steps to C records
(records) and run the program (executor). docs/architecture.md walks through it."""
from .builder import Graph
from .ir import GraphError
from .executor import DynamicPlan, Plan
from .records import PY_STEPS

__all__ = ["Graph", "GraphError", "Plan", "DynamicPlan", "PY_STEPS"]
