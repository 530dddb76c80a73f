"""Op graphs: build nodes (builder), fuse them into steps (fusion), lower the steps to C records
(records) and run the program (executor). docs/architecture.md walks through it."""
from .executor import PY_STEPS, DynamicPlan, Graph, GraphError, Plan

__all__ = ["Graph", "GraphError", "Plan", "DynamicPlan", "PY_STEPS"]
