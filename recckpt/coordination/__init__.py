"""Coordination between workers: who writes what and who commits a save (coordinator), what every
rank agrees on at a step boundary (agreement), on recckpt's own gloo groups (groups)."""
from .agreement import Agreement, LocalAgreement, agreement_for
from .coordinator import Coordinator, InProcessCoordinator, SingleCoordinator
from .factory import coordinator_for
from .world import check_world, resolve_shard

__all__ = ["Agreement", "LocalAgreement", "agreement_for", "Coordinator", "InProcessCoordinator",
           "SingleCoordinator", "coordinator_for", "check_world", "resolve_shard"]
