"""What every training command shares around its loop: where its arrays live (`jaxspec.run.placement`:
one device or a mesh), the run directory's guard, checkpoints and resume, batches by data position,
stop signals and exit statuses, metrics files, progress output, and the loop itself (`RunLoop`)."""

from jaxspec.exits import EXIT_CHECKPOINTED
from jaxspec.run.batcher import Batcher
from jaxspec.run.checkpoints import Checkpointer
from jaxspec.run.loop import Program, RunLoop, RunOutcome
from jaxspec.run.metrics_log import MetricsLog, truncate_metrics
from jaxspec.run.progress import Progress
from jaxspec.run.run_dir import FixedKeys, check_run_dir
from jaxspec.run.signals import StopSignals

__all__ = [
    "EXIT_CHECKPOINTED",
    "Batcher",
    "Checkpointer",
    "FixedKeys",
    "MetricsLog",
    "Program",
    "Progress",
    "RunLoop",
    "RunOutcome",
    "StopSignals",
    "check_run_dir",
    "truncate_metrics",
]
