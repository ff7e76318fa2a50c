"""The checks of a ``--mita-cfg`` dict (a swap's single keys): :func:`check_mita_cfg` and
the rules it applies (:func:`mita_cfg_rules`): the MiTA settings of
:class:`~mita_seg.setting.MiTASetting` (their defaults, :data:`~mita_seg.models.MITA_DEFAULTS`)
and the layer choice of :func:`~mita_seg.swap_attention` (``layers``, ``include_head``). An
unknown name or a bad value is a ``MiTASettingError`` (a ``ValueError``) naming the setting
and what it accepts; so is ``router_topk`` above the ``M`` landmarks of the ``pool_size``
given (or of the default pool, or of each pool a tool sweeps).

The command line around it (``--swap-attn``, ``--mita-cfg``, ``--mita-plan``,
``--dense-attn``, checked while parsing) is the tools' (``cli/swap_args.py``).
"""
from collections.abc import Mapping
from typing import Any, Dict, Optional, Sequence, Union

from mita_seg.setting import (MITA_DEFAULTS, SETTING_KEYS, SETTING_RULES, MiTASetting,
                              check_settings)

# mita_seg.models (the rules of swap_attention) is imported where it is used: a tool builds
# its parser, and refuses a bad setting, without importing the mm stack.


def mita_cfg_rules(exclude: Sequence[str] = ()) -> Dict[str, tuple]:
    """``name -> (what it must be, check)`` of the settings ``--mita-cfg`` accepts:
    the MiTA settings and ``layers``/``include_head``, less ``exclude``."""
    from mita_seg.models import SWAP_RULES
    rules = {k: SETTING_RULES[k] for k in SETTING_KEYS}
    rules.update(SWAP_RULES)
    return {k: v for k, v in rules.items() if k not in exclude}


def check_mita_cfg(mita_cfg: Dict[str, Any], exclude: Sequence[str] = (),
                   pool_sizes: Optional[Sequence[Any]] = None) -> Dict[str, Any]:
    """Check a ``--mita-cfg`` dict (``MiTASettingError``, a ``ValueError``, naming the
    setting and what it accepts).

    Args:
        mita_cfg (dict): parsed ``key=value`` pairs.
        exclude (Sequence[str]): settings a tool sets by other means.
        pool_sizes (Sequence, optional): the pool sizes ``router_topk`` must fit, for a
            tool that sets ``pool_size`` itself. Default: the ``pool_size`` given, else
            the default one.

    Returns:
        dict: ``mita_cfg`` unchanged.
    """
    check_settings(mita_cfg, mita_cfg_rules(exclude))
    if 'router_topk' in mita_cfg:
        pools = pool_sizes or [mita_cfg.get('pool_size', MITA_DEFAULTS['pool_size'])]
        if not pool_sizes and 'pool_size' in exclude:
            pools = []        # the tool sets the pools and checks them itself
        for pool in pools:
            check_settings(dict(pool_size=pool, router_topk=mita_cfg['router_topk']))
    return mita_cfg


def as_mita_cfg(mita_cfg: Union[dict, str, MiTASetting, None]) -> dict:
    """``mita_cfg`` in any spelling the APIs take, as the keyword arguments of
    :func:`~mita_seg.swap_attention`: a dict (``--mita-cfg``'s settings, ``layers``,
    ``include_head``; its ``setting`` a :class:`~mita_seg.setting.MiTASetting`, its text or
    a dict of settings; or ``{'plan': SwapPlan}``), a whole setting (``'7:49'``, a
    ``MiTASetting``) or None (MiTA's defaults). A copy: the caller's dict is left as it is.

    Raises:
        MiTASettingError: a setting that is none of these.
    """
    if mita_cfg is None:
        return {}
    if not isinstance(mita_cfg, Mapping):
        return dict(setting=MiTASetting.of(mita_cfg))
    mita_cfg = dict(mita_cfg)
    if mita_cfg.get('setting') is not None:
        mita_cfg['setting'] = MiTASetting.of(mita_cfg['setting'])
    return mita_cfg
