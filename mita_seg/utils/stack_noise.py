"""What the mm stack prints around a tool's result and a user can do nothing about: its own
deprecation warnings, mmengine's "Failed to search registry" records... :func:`quiet_stack`
silences them in a process, :func:`is_stack_noise` is the ``logging`` filter (also on the
console of :class:`~mita_seg.apis.QuietRunner`). No torch, no mm stack at import."""

__all__ = ['STACK_PACKAGES', 'STACK_WARNINGS', 'STACK_LOG_NOISE', 'is_stack_noise',
           'quiet_stack']

# Warnings raised inside these packages (deprecations of the stack's own calls, mmengine's
# "Failed to add LocalVisBackend"...) ...
STACK_PACKAGES = ('mmcv', 'mmengine', 'mmseg')
# ... warnings raised elsewhere on the stack's behalf (message starts) ...
STACK_WARNINGS = ('pkg_resources is deprecated as an API', )
# ... and mmengine log records (message starts).
STACK_LOG_NOISE = ('Failed to search registry with scope', 'Distributed training is not used',
                   'The prefix is not set in metric class')


def is_stack_noise(record) -> bool:
    """A ``logging`` filter: False for a record of :data:`STACK_LOG_NOISE`."""
    return not str(record.msg).lstrip().startswith(STACK_LOG_NOISE)


def quiet_stack() -> None:
    """Silence the stack's known noise in this process (:data:`STACK_PACKAGES`,
    :data:`STACK_WARNINGS`, :data:`STACK_LOG_NOISE`), not mita_seg's own warnings nor those
    of a user's code. A tool calls it once its arguments are parsed; the log file of a run
    keeps mmengine's records (:class:`~mita_seg.apis.QuietRunner` filters its console
    only). Imports mmengine's logging."""
    import warnings
    for package in STACK_PACKAGES:
        warnings.filterwarnings('ignore', module=rf'{package}(\.|$)')
    for message in STACK_WARNINGS:
        warnings.filterwarnings('ignore', message=message)
    from mmengine.logging import MMLogger
    logger = MMLogger.get_instance('mmengine')
    if is_stack_noise not in logger.filters:
        logger.addFilter(is_stack_noise)
