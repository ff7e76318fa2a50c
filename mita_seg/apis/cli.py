"""What every tool shares around its ``main``: errors a user can fix end the tool with a
short message and exit status 1 instead of a traceback."""
import sys
from typing import Callable

from mita_seg.models import GridMismatchError, NothingToMergeError, NothingToSwapError, PlanError
from mita_seg.ops.onnx import OnnxExportError
from mita_seg.utils.checkpoint import (CheckpointMismatchError, UnreadableCheckpointError,
                                       UnsafeCheckpointError)

# What a user fixes by changing the command line, the config or the checkpoint.
USER_ERRORS = (FileNotFoundError, UnreadableCheckpointError, UnsafeCheckpointError,
               CheckpointMismatchError, NothingToSwapError, GridMismatchError,
               NothingToMergeError, OnnxExportError, PlanError)


def run_tool(main: Callable[[], object]) -> None:
    """Run a tool's ``main()``; a user error (:data:`USER_ERRORS`: a missing file, an
    unreadable, unsafe or non-fitting checkpoint, nothing to swap, a BEiT/MAE run at a grid
    its bias tables do not fit, a swap plan that does not fit the model or a calibration
    that cannot run) prints
    ``error: <message>`` and exits with status 1."""
    try:
        main()
    except USER_ERRORS as e:
        print(f'error: {e}', file=sys.stderr)
        sys.exit(1)
