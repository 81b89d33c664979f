"""Coordination between the workers of one save: who writes what, who commits."""
from .coordinator import Coordinator, InProcessCoordinator, SingleCoordinator, coordinator_for
from .world import resolve_shard

__all__ = ["Coordinator", "InProcessCoordinator", "SingleCoordinator", "coordinator_for", "resolve_shard"]
