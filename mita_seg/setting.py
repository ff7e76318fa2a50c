"""One MiTA setting: its rules, its spelling, its label and its config.

Imports neither torch nor the mm stack, so a tool can parse and check settings before it
imports them. The one spelling a user types, wherever a tool takes a setting::

    7:49          pool 7 x 7 (M = 49 landmarks), top-k 49, with the shared expert
    4x6:16        a 4 x 6 pool (M = 24), top-k 16
    7:49:route    route-only (no shared expert)
    dense         softmax attention, where a list of settings allows it

(``--mita-cfg key=value`` sets single keys, checked by the same :data:`SETTING_RULES`.)
:class:`MiTASetting` holds one setting: :meth:`~MiTASetting.parse` reads the spelling,
:attr:`~MiTASetting.text` writes it back, :attr:`~MiTASetting.label` is what tables, logs
and plots show (``M=7x7 k=49``, ``M=4x4 k=16 route-only``), :meth:`~MiTASetting.cfg` is the
dict of :func:`~mita_seg.swap_attention` and ``MiTAAttention.configure``, and
:meth:`~MiTASetting.from_cfg` reads such a dict back.
"""
import re
from dataclasses import dataclass, fields
from numbers import Real
from typing import Any, Callable, Dict, Iterable, Optional, Tuple, Union

# The MiTA settings of an attention module (what configs' mita_cfg and --mita-cfg set).
MITA_KEYS = ('pool_size', 'topk', 'router_topk', 'with_shared_expert', 'shared_scale')
# Their defaults (MiTAAttention's signature has the same: tests/test_small_grids.py checks it).
MITA_DEFAULTS: Dict[str, Any] = dict(pool_size=7, topk=49, router_topk=1,
                                     with_shared_expert=True, shared_scale=None)
DENSE = 'dense'
EXAMPLES = '7:49, 4x6:16 or 7:49:route'
# The per-layer candidates a swap plan is calibrated over by default
# (mita_seg.apis.calibrate_swap, tools/calibrate_swap.py): dense, pool 4/5/7 x k 16/49/100,
# with the shared expert and route-only.
CALIBRATION_CANDIDATES = (DENSE, ) + tuple(
    f'{p}:{k}{s}' for p in (4, 5, 7) for k in (16, 49, 100) for s in ('', ':route'))


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_pool(x: Any) -> bool:
    if _is_int(x):
        return x >= 1
    return (isinstance(x, (tuple, list)) and len(x) == 2
            and all(_is_int(i) and i >= 1 for i in x))


def pool_pair(pool: Union[int, Tuple[int, int]]) -> Tuple[int, int]:
    """``(Ph, Pw)`` of a pool size (an int ``P`` is ``P x P``)."""
    return (pool, pool) if _is_int(pool) else (int(pool[0]), int(pool[1]))


# setting -> (what it must be, check)
SETTING_RULES: Dict[str, Tuple[str, Callable[[Any], bool]]] = {
    'pool_size': ('an int >= 1 or a pair [h, w] of them', _is_pool),
    'topk': ('an int >= 1', lambda x: _is_int(x) and x >= 1),
    'router_topk': ('an int >= 1', lambda x: _is_int(x) and x >= 1),
    'with_shared_expert': ('True or False', lambda x: isinstance(x, bool)),
    'shared_scale': ('a number > 0, or None for 1/d',
                     lambda x: x is None or (isinstance(x, Real) and not isinstance(x, bool)
                                             and x > 0)),
    'with_dwc': ('True or False', lambda x: isinstance(x, bool)),
}


class MiTASettingError(ValueError):
    """A MiTA setting (or a layer choice) that cannot be used: an unknown name, a bad value,
    ``router_topk`` above the number of landmarks, a layer the model does not have, a
    setting spelled wrong."""


def check_settings(settings: Dict[str, Any],
                   rules: Optional[Dict[str, Tuple[str, Callable]]] = None) -> Dict[str, Any]:
    """Check names and values of settings against ``rules`` (default: the MiTA settings).

    Args:
        settings (dict): e.g. ``dict(pool_size=7, topk=49)``.
        rules (dict, optional): ``name -> (description, check)``. Default:
            :data:`SETTING_RULES`.

    Returns:
        dict: ``settings`` (unchanged) when every name is known and every value valid.

    Raises:
        MiTASettingError: an unknown name (the message lists the allowed ones), a bad value
            (the message says what the value must be), or ``router_topk`` above the
            ``M = Ph * Pw`` landmarks of ``pool_size`` given with it.
    """
    rules = SETTING_RULES if rules is None else rules
    for key, value in settings.items():
        if key not in rules:
            raise MiTASettingError(f'unknown MiTA setting {key!r}; allowed: '
                                   + ', '.join(f'{k} ({rules[k][0]})' for k in rules))
        what, ok = rules[key]
        if not ok(value):
            raise MiTASettingError(f'{key}={value!r}: {key} must be {what}')
    if 'pool_size' in settings and 'router_topk' in settings:
        ph, pw = pool_pair(settings['pool_size'])
        if settings['router_topk'] > ph * pw:
            raise MiTASettingError(
                f"router_topk={settings['router_topk']} is more than the M={ph * pw} "
                f"landmarks (experts) of pool_size={settings['pool_size']}: a query reads at "
                f'most M experts; give router_topk <= {ph * pw} or a larger pool_size')
    return settings


_SPELLING = re.compile(r'^(\d+)(?:x(\d+))?:(\d+)(:route)?$')


@dataclass(frozen=True)
class MiTASetting:
    """One MiTA setting (the arguments of ``MiTAAttention`` that choose what it computes).

    Args:
        pool_size (int | tuple[int, int]): landmark grid, ``M = Ph * Pw`` experts (a square
            pair is kept as its side).
        topk (int): keys per routed expert.
        router_topk (int): experts per query. Default: 1.
        with_shared_expert (bool): the shared (compression) expert; False is route-only.
            Default: True.
        shared_scale (float, optional): scale of the shared logits, None for ``1 / d``.
            Default: None.

    Raises:
        MiTASettingError: a bad value (:func:`check_settings`).
    """
    pool_size: Union[int, Tuple[int, int]]
    topk: int
    router_topk: int = 1
    with_shared_expert: bool = True
    shared_scale: Optional[float] = None

    def __post_init__(self):
        check_settings({f.name: getattr(self, f.name) for f in fields(self)})
        ph, pw = pool_pair(self.pool_size)
        object.__setattr__(self, 'pool_size', ph if ph == pw else (ph, pw))

    @classmethod
    def parse(cls, text: str) -> 'MiTASetting':
        """The setting a user typed: ``P:K``, ``PhxPw:K``, with ``:route`` for route-only
        (``7:49``, ``4x6:16``, ``7:49:route``).

        Raises:
            MiTASettingError: anything else (the message names the text and shows the
                spelling; the old ``7,49`` is shown as ``7:49``).
        """
        m = _SPELLING.match(text.strip()) if isinstance(text, str) else None
        if m is None or min(int(v) for v in m.group(1, 3) + (m.group(2) or '1', )) < 1:
            hint = ''
            if isinstance(text, str) and re.match(r'^\d+(,\d+)+$', text.strip()):
                parts = text.strip().split(',')
                hint = f' ({text!r} is the old spelling: write {":".join(parts[:2])})'
            raise MiTASettingError(
                f'MiTA setting {text!r}: write P:K (pool P x P, top-k K, shared expert), '
                f'PhxPw:K (a Ph x Pw pool) or P:K:route (route-only), e.g. {EXAMPLES}{hint}')
        ph, pw, k, route = m.group(1), m.group(2) or m.group(1), m.group(3), m.group(4)
        return cls((int(ph), int(pw)), int(k), with_shared_expert=not route)

    @classmethod
    def parse_or_dense(cls, text: str) -> Optional['MiTASetting']:
        """:meth:`parse`, or None for ``dense`` (softmax attention), where a list of
        settings allows it.

        Raises:
            MiTASettingError: anything else (the message shows ``dense`` too).
        """
        if isinstance(text, str) and text.strip() == DENSE:
            return None
        try:
            return cls.parse(text)
        except MiTASettingError as e:
            raise MiTASettingError(f'{e}; or {DENSE} (softmax attention)') from None

    @classmethod
    def from_cfg(cls, cfg: Dict[str, Any]) -> 'MiTASetting':
        """The setting of a dict of MiTA settings (:data:`MITA_KEYS`, as ``cfg`` gives
        them); those not given are the defaults (:data:`MITA_DEFAULTS`).

        Raises:
            MiTASettingError: a key that is not a MiTA setting, or a bad value.
        """
        check_settings(cfg, {k: SETTING_RULES[k] for k in MITA_KEYS})
        return cls(**{**MITA_DEFAULTS, **cfg})

    def cfg(self) -> Dict[str, Any]:
        """The settings as a dict, every key of :data:`MITA_KEYS` (``swap_attention(model,
        **s.cfg())``, ``MiTAAttention.configure(**s.cfg())``, a config's ``mita_cfg``)."""
        return {f.name: getattr(self, f.name) for f in fields(self)}

    @property
    def pool(self) -> Tuple[int, int]:
        """``(Ph, Pw)``."""
        return pool_pair(self.pool_size)

    @property
    def num_experts(self) -> int:
        """``M = Ph * Pw``."""
        return self.pool[0] * self.pool[1]

    @property
    def text(self) -> str:
        """The spelling :meth:`parse` reads (``7:49``, ``4x6:16``, ``7:49:route``); a
        ``router_topk`` or ``shared_scale`` off its default, which the spelling has no place
        for, follows as ``key=value``."""
        ph, pw = self.pool
        out = (f'{ph}' if ph == pw else f'{ph}x{pw}') + f':{self.topk}'
        out += '' if self.with_shared_expert else ':route'
        return ' '.join([out] + _extras(self.cfg()))

    @property
    def label(self) -> str:
        """What tables, logs and plots show: ``M=7x7 k=49``, ``M=4x4 k=16 route-only``, a
        ``router_topk`` or ``shared_scale`` off its default as ``key=value``."""
        return label(self)

    def ran_label(self, pools: Iterable[Tuple[int, int]] = (),
                  every_key: Iterable[bool] = ()) -> str:
        """The label of this setting as it ran, where that is less than it asks: a pool
        larger than the patch grid runs on the grid (``M=16x16 k=49 (asked M=20x20)``;
        grids of several sizes: ``M=4x4/16x16``), a ``k`` of at least the tokens reads every
        key (``k=100000 (every key)``, or ``(every key in some layers)``).

        Args:
            pools (Iterable[tuple[int, int]]): the landmark grids the calls ran with (none:
                as asked).
            every_key (Iterable[bool]): per call, whether it read every key (``k >= N``).
        """
        pools = set(pools) or {self.pool}
        ran = MiTASetting(max(pools, key=lambda p: p[0] * p[1]), self.topk, 1,
                          self.with_shared_expert, self.shared_scale)
        out = label(ran).split(' ')
        out[0] = 'M=' + '/'.join(f'{h}x{w}' for h, w in sorted(pools))
        every_key = list(every_key)
        if every_key and all(every_key):
            out.insert(2, '(every key)')
        elif any(every_key):
            out.insert(2, '(every key in some layers)')
        if self.router_topk != MITA_DEFAULTS['router_topk']:
            out.append(f'router_topk={self.router_topk}')
        if pools != {self.pool}:
            out.append(f'(asked M={self.pool[0]}x{self.pool[1]})')
        return ' '.join(out)


def _extras(cfg: Dict[str, Any]) -> list:
    """``router_topk``/``shared_scale`` of ``cfg`` off their defaults, as ``key=value``."""
    return [f'{k}={cfg[k]}' for k in ('router_topk', 'shared_scale')
            if k in cfg and cfg[k] != MITA_DEFAULTS[k]]


def label(setting: Union[MiTASetting, Dict[str, Any], None]) -> str:
    """The label of a setting, of a dict of MiTA settings (some may be missing, as in a
    plan's layer: only those given are shown) or of dense attention (None): ``dense``,
    ``M=7x7 k=49``, ``M=4x4 k=16 route-only``, ``k=16``; settings at their defaults are
    left out."""
    if setting is None:
        return DENSE
    cfg = setting.cfg() if isinstance(setting, MiTASetting) else setting
    parts = []
    if 'pool_size' in cfg:
        ph, pw = pool_pair(cfg['pool_size'])
        parts.append(f'M={ph}x{pw}')
    if 'topk' in cfg:
        parts.append(f'k={cfg["topk"]}')
    if cfg.get('with_shared_expert') is False:
        parts.append('route-only')
    parts += _extras(cfg)
    return ' '.join(parts) or 'MiTA (defaults)'


def setting_arg(text: str) -> MiTASetting:
    """An argparse ``type``: :meth:`MiTASetting.parse` (a bad one is a usage error)."""
    import argparse
    try:
        return MiTASetting.parse(text)
    except MiTASettingError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def setting_or_dense_arg(text: str) -> Optional[MiTASetting]:
    """An argparse ``type``: :meth:`MiTASetting.parse_or_dense`."""
    import argparse
    try:
        return MiTASetting.parse_or_dense(text)
    except MiTASettingError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
