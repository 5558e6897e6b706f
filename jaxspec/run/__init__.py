"""What every training command shares around its loop: checkpoints and resume, stop signals and
exit statuses, metrics files, progress output."""

from jaxspec.run.checkpoints import Checkpointer, truncate_metrics
from jaxspec.run.progress import Progress
from jaxspec.run.signals import EXIT_CHECKPOINTED, StopSignals

__all__ = ["EXIT_CHECKPOINTED", "Checkpointer", "Progress", "StopSignals", "truncate_metrics"]
