"""What the stack prints around a tool's result and a user can do nothing about: the mm
stack's own deprecation warnings, mmengine's "Failed to search registry" records, the ONNX
exporter's notes... :func:`quiet_stack` silences the mm stack's in a process,
:func:`is_stack_noise` is the ``logging`` filter (also on the console of
:class:`~mita_seg.apis.QuietRunner`), :func:`quiet_exporter` silences the exporter's around
one export. Each names what it silences, by package, message or logger, so mita_seg's own
warnings and those of a user's code still show. No torch, no mm stack at import."""
import contextlib
import logging
import re
import warnings

__all__ = ['STACK_PACKAGES', 'STACK_WARNINGS', 'STACK_LOG_NOISE', 'EXPORTER_WARNINGS',
           'EXPORTER_LOGGERS', 'is_stack_noise', 'quiet_stack', 'quiet_exporter']

# Warnings raised inside these packages (deprecations of the stack's own calls, mmengine's
# "Failed to add LocalVisBackend"...) ...
STACK_PACKAGES = ('mmcv', 'mmengine', 'mmseg')
# ... warnings raised elsewhere on the stack's behalf (message starts) ...
STACK_WARNINGS = ('pkg_resources is deprecated as an API', )
# ... and mmengine log records (message starts).
STACK_LOG_NOISE = ('Failed to search registry with scope', 'Distributed training is not used',
                   'The prefix is not set in metric class')

# The ONNX exporter (torch.onnx.export(..., dynamo=True)): torch.export's deprecation of its
# own LeafSpec, warned as it copies its module call graph (message starts) ...
EXPORTER_WARNINGS = ('`isinstance(treespec, LeafSpec)` is deprecated', )
# ... and the loggers of its passes, whose notes below ERROR are not a user's: the registry
# lists every torchvision op it skips, onnxscript's constant folding each op it leaves as it
# is ("Skipping constant folding for op Split with multiple outputs.").
EXPORTER_LOGGERS = ('torch.onnx._internal.exporter._registration',
                    'onnxscript.optimizer._constant_folding')


def is_stack_noise(record) -> bool:
    """A ``logging`` filter: False for a record of :data:`STACK_LOG_NOISE`."""
    return not str(record.msg).lstrip().startswith(STACK_LOG_NOISE)


def quiet_stack() -> None:
    """Silence the stack's known noise in this process (:data:`STACK_PACKAGES`,
    :data:`STACK_WARNINGS`, :data:`STACK_LOG_NOISE`), not mita_seg's own warnings nor those
    of a user's code. A tool calls it once its arguments are parsed; the log file of a run
    keeps mmengine's records (:class:`~mita_seg.apis.QuietRunner` filters its console
    only). Imports mmengine's logging."""
    for package in STACK_PACKAGES:
        warnings.filterwarnings('ignore', module=rf'{package}(\.|$)')
    for message in STACK_WARNINGS:
        warnings.filterwarnings('ignore', message=re.escape(message))
    from mmengine.logging import MMLogger
    logger = MMLogger.get_instance('mmengine')
    if is_stack_noise not in logger.filters:
        logger.addFilter(is_stack_noise)


@contextlib.contextmanager
def quiet_exporter():
    """Within: the ONNX exporter's noise silenced, :data:`EXPORTER_WARNINGS` and the records
    below ERROR of :data:`EXPORTER_LOGGERS`; every other warning (mita_seg's own, a user's)
    and the exporter's errors show as they are. The warning filters and the loggers' levels
    are as they were after."""
    loggers = [logging.getLogger(name) for name in EXPORTER_LOGGERS]
    levels = [logger.level for logger in loggers]
    with warnings.catch_warnings():
        for message in EXPORTER_WARNINGS:
            warnings.filterwarnings('ignore', message=re.escape(message),
                                    category=FutureWarning)
        for logger in loggers:
            logger.setLevel(logging.ERROR)
        try:
            yield
        finally:
            for logger, level in zip(loggers, levels):
                logger.setLevel(level)
