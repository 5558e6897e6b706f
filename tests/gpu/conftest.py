"""The GPU checks share the GPUs with the child processes some of them start (rollouts per
implementation, `jaxspec train` per layout): this process takes GPU memory as it needs it rather
than JAX's default 75% at start-up."""

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
