"""Op graphs: build nodes (builder), then the stages fuse(graph) -> steps (fusion),
lower(graph, steps, isa) -> program (records) and Plan(program) (executor); the data between them
is in ir. docs/architecture.md walks through it."""
from .builder import Graph
from .ir import GraphError
from .executor import DynamicPlan, Plan
from .records import PY_STEPS

__all__ = ["Graph", "GraphError", "Plan", "DynamicPlan", "PY_STEPS"]
