"""Coordination between the workers of one save: who writes what, who commits."""
from .coordinator import Coordinator, InProcessCoordinator, SingleCoordinator, coordinator_for

__all__ = ["Coordinator", "InProcessCoordinator", "SingleCoordinator", "coordinator_for"]
