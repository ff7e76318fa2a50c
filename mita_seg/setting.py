"""One attention setting: its kind, rules, spelling, label, config and cost.

Imports neither torch nor the mm stack, so a tool can parse and check settings before it
imports them. The one spelling a user types, wherever a tool takes a setting::

    7:49          MiTA: pool 7 x 7 (M = 49 landmarks), top-k 49, with the shared expert
    4x6:16        MiTA with a 4 x 6 pool (M = 24), top-k 16
    7:49:route    MiTA route-only (no shared expert)
    agent:7       compression only: one softmax over M = 7 x 7 pooled landmarks (Agent
                  Attention; MiTA's shared expert alone)
    block:8:4     block routing (MoBA): 8 x 8-token blocks of the grid, each query attends
                  to its own block and the 3 others whose mean key it matches best
    topk:49       per-query top-k: each query attends to its own 49 best keys
    window:7      a local 7 x 7 window of the grid around each query (neighbourhood
                  attention, shifted inward at the borders)
    dense         softmax attention, where a list of settings allows it

Every kind but MiTA treats the tokens outside the patch grid (cls, Segmenter's class
tokens) as global: keys in every query's softmax, queries attending to every key.
(``--mita-cfg key=value`` sets single keys, checked by the same :data:`SETTING_RULES`.)
:class:`MiTASetting` holds one setting of any kind (:data:`KINDS`): :meth:`~MiTASetting.parse`
reads the spelling, :attr:`~MiTASetting.text` writes it back, :attr:`~MiTASetting.label` is
what tables, logs and plots show (``M=7x7 k=49``, ``agent M=7x7``, ``window 7x7``),
:meth:`~MiTASetting.cfg` is the dict of :func:`~mita_seg.swap_attention` and
``MiTAAttention.configure``, :meth:`~MiTASetting.from_cfg` reads such a dict back, and
:meth:`~MiTASetting.attention_macs` is its cost. A setting is checked once, when it is made.
"""
import dataclasses
import re
from dataclasses import dataclass, fields
from numbers import Real
from typing import Any, Callable, Dict, Iterable, Optional, Tuple, Union

# The MiTA settings of an attention module (what configs' mita_cfg and --mita-cfg set).
MITA_KEYS = ('pool_size', 'topk', 'router_topk', 'with_shared_expert', 'shared_scale')
# Their defaults (MiTAAttention's signature has the same: tests/test_small_grids.py checks it).
MITA_DEFAULTS: Dict[str, Any] = dict(pool_size=7, topk=49, router_topk=1,
                                     with_shared_expert=True, shared_scale=None)
# The kind of attention and the settings only other kinds read, with their defaults.
KIND_DEFAULTS: Dict[str, Any] = dict(kind='mita', block_size=8, num_blocks=4, window=7)
# Every setting of a swapped attention module (its attributes), and the defaults.
SETTING_KEYS = MITA_KEYS + tuple(KIND_DEFAULTS)
SETTING_DEFAULTS: Dict[str, Any] = {**MITA_DEFAULTS, **KIND_DEFAULTS}
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
    'kind': ("one of 'mita', 'agent', 'block', 'topk', 'window'",
             lambda x: x in ('mita', 'agent', 'block', 'topk', 'window')),
    'block_size': ('an int >= 1 (blocks of block_size x block_size grid tokens)',
                   lambda x: _is_int(x) and x >= 1),
    'num_blocks': ('an int >= 1', lambda x: _is_int(x) and x >= 1),
    'window': ('an int >= 1 (a window x window neighbourhood)', lambda x: _is_int(x) and x >= 1),
}


@dataclass(frozen=True)
class Kind:
    """One kind of attention a setting can choose.

    Attributes:
        name (str): what ``kind`` says (``'mita'``, ``'agent'``...).
        keys (tuple[str]): the settings it reads (the others are left at their defaults).
        spelling (str): how a user writes it (``agent:P``).
        pattern (str): the regular expression of the spelling; its groups are ``keys``'
            values, in order, as ints (a ``PhxPw`` pool: two groups).
        title (str): the family it stands for, in words.
    """
    name: str
    keys: Tuple[str, ...]
    spelling: str
    pattern: str
    title: str


# The kinds, in the paper's taxonomy: MiTA, compression only, block routing, per-query top-k,
# and a local window (what the attention of a token sees when it cannot reach far).
KINDS: Dict[str, Kind] = {k.name: k for k in (
    Kind('mita', MITA_KEYS, 'P:K, PhxPw:K or P:K:route', '', 'MiTA (landmarks, shared and '
         'routed top-k experts)'),
    Kind('agent', ('pool_size', 'shared_scale'), 'agent:P or agent:PhxPw',
         r'^agent:(\d+)(?:x(\d+))?$', 'compression only (Agent Attention: MiTA\'s shared '
         'expert alone)'),
    Kind('block', ('block_size', 'num_blocks'), 'block:S:B', r'^block:(\d+):(\d+)$',
         'block routing (MoBA: S x S-token blocks, B per query)'),
    Kind('topk', ('topk', ), 'topk:K', r'^topk:(\d+)$', 'per-query top-k keys'),
    Kind('window', ('window', ), 'window:W', r'^window:(\d+)$',
         'a local W x W window (neighbourhood attention)'),
)}


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


# The settings already checked (their field values): settings are immutable, so a setting
# made again (by every swapped module, by each tool it passes through) is not checked again.
_CHECKED: set = set()

_SPELLING = re.compile(r'^(\d+)(?:x(\d+))?:(\d+)(:route)?$')


@dataclass(frozen=True)
class MiTASetting:
    """One attention setting (the arguments of ``MiTAAttention`` that choose what it
    computes): MiTA's, or another kind's (:data:`KINDS`), checked when it is made.

    Args:
        pool_size (int | tuple[int, int]): landmark grid, ``M = Ph * Pw`` experts (a square
            pair is kept as its side). MiTA, agent.
        topk (int): keys per routed expert (MiTA), per query (top-k).
        router_topk (int): experts per query. Default: 1. MiTA.
        with_shared_expert (bool): the shared (compression) expert; False is route-only.
            Default: True. MiTA.
        shared_scale (float, optional): scale of the shared logits, None for ``1 / d``.
            Default: None. MiTA, agent.
        kind (str): ``'mita'`` (default), ``'agent'``, ``'block'``, ``'topk'`` or
            ``'window'``.
        block_size (int): block side in grid tokens. Default: 8. Block.
        num_blocks (int): blocks per query, its own included. Default: 4. Block.
        window (int): window side in grid tokens. Default: 7. Window.

    Raises:
        MiTASettingError: a bad value (:func:`check_settings`).
    """
    pool_size: Union[int, Tuple[int, int]] = MITA_DEFAULTS['pool_size']
    topk: int = MITA_DEFAULTS['topk']
    router_topk: int = 1
    with_shared_expert: bool = True
    shared_scale: Optional[float] = None
    kind: str = 'mita'
    block_size: int = KIND_DEFAULTS['block_size']
    num_blocks: int = KIND_DEFAULTS['num_blocks']
    window: int = KIND_DEFAULTS['window']

    def __post_init__(self):
        given = self._key()
        if given not in _CHECKED:  # a setting is checked once: it cannot change
            check_settings({f.name: getattr(self, f.name) for f in fields(self)})
        ph, pw = pool_pair(self.pool_size)
        object.__setattr__(self, 'pool_size', ph if ph == pw else (ph, pw))
        _CHECKED.update((given, self._key()))

    def _key(self) -> tuple:
        """The field values, hashable."""
        return tuple(tuple(v) if isinstance(v, list) else v
                     for v in (getattr(self, f.name) for f in fields(self)))

    @classmethod
    def parse(cls, text: str) -> 'MiTASetting':
        """The setting a user typed: MiTA's ``P:K``, ``PhxPw:K``, with ``:route`` for
        route-only (``7:49``, ``4x6:16``, ``7:49:route``), or another kind's spelling
        (``agent:7``, ``block:8:4``, ``topk:49``, ``window:7``).

        Raises:
            MiTASettingError: anything else (the message names the text and shows the
                spelling; the old ``7,49`` is shown as ``7:49``).
        """
        text_ = text.strip() if isinstance(text, str) else ''
        kind = KINDS.get(text_.split(':')[0])
        if kind is not None and kind.pattern:
            m = re.match(kind.pattern, text_)
            if m is None or min(int(v) for v in m.groups() if v is not None) < 1:
                raise MiTASettingError(f'{kind.name} setting {text!r}: write {kind.spelling} '
                                       f'(positive integers), e.g. {_example(kind)}')
            values = [int(v) for v in m.groups() if v is not None]
            if kind.keys[0] == 'pool_size':  # agent:P or agent:PhxPw
                values = [tuple(values) if len(values) == 2 else values[0]]
            return cls(kind=kind.name, **dict(zip(kind.keys, values)))
        m = _SPELLING.match(text_)
        if m is None or min(int(v) for v in m.group(1, 3) + (m.group(2) or '1', )) < 1:
            hint = ''
            if isinstance(text, str) and re.match(r'^\d+(,\d+)+$', text.strip()):
                parts = text.strip().split(',')
                hint = f' ({text!r} is the old spelling: write {":".join(parts[:2])})'
            others = ', '.join(_example(k) for k in KINDS.values() if k.pattern)
            raise MiTASettingError(
                f'MiTA setting {text!r}: write P:K (pool P x P, top-k K, shared expert), '
                f'PhxPw:K (a Ph x Pw pool) or P:K:route (route-only), e.g. {EXAMPLES}{hint}; '
                f'or another kind: {others}')
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
        """The setting of a dict of settings (:meth:`cfg`'s: ``kind`` and that kind's keys;
        :data:`MITA_KEYS` without ``kind``); those not given are the defaults.

        Raises:
            MiTASettingError: a key that is not a setting of that kind, or a bad value.
        """
        kind = KINDS.get(cfg.get('kind', 'mita'))
        allowed = ('kind', ) + (kind.keys if kind else SETTING_KEYS)
        if kind is None or set(cfg) - set(allowed):  # say what is wrong, as check_settings does
            check_settings(cfg, {k: SETTING_RULES[k] for k in allowed})
        return cls(**cfg)

    def replace(self, **settings) -> 'MiTASetting':
        """This setting with some keys (:data:`SETTING_KEYS`) changed, e.g. ``topk=16``.

        Raises:
            MiTASettingError: an unknown key or a bad value.
        """
        if set(settings) - set(SETTING_KEYS):
            check_settings(settings, {k: SETTING_RULES[k] for k in SETTING_KEYS})
        return dataclasses.replace(self, **settings)

    def cfg(self) -> Dict[str, Any]:
        """The settings as a dict (``swap_attention(model, **s.cfg())``,
        ``MiTAAttention.configure(**s.cfg())``, a config's ``mita_cfg``, a plan's layer):
        every key of :data:`MITA_KEYS` for MiTA, ``kind`` and the keys it reads for another
        kind."""
        keys = KINDS[self.kind].keys
        head = {} if self.kind == 'mita' else {'kind': self.kind}
        return {**head, **{k: getattr(self, k) for k in keys}}

    def attention_macs(self, hw_shape: Tuple[int, int], num_tokens: int, head_dim: int,
                       num_global_tokens: int = 0) -> int:
        """Multiply-adds of this attention per batch item and head (one MAC = one FLOP),
        over ``num_tokens`` tokens of which the ``h x w`` grid and ``num_global_tokens``
        global ones, as the module runs it (a pool, k or window larger than the grid
        clamped to it): the formulas of :mod:`mita_seg.ops.flops`."""
        from mita_seg.ops import flops
        h, w = hw_shape
        if self.kind == 'mita':
            T = num_global_tokens
            M = min(self.pool[0], h) * min(self.pool[1], w)
            return (flops.mita_flops_per_head(num_tokens - T, head_dim, M,
                                              min(self.topk, num_tokens - T),
                                              min(self.router_topk, M),
                                              self.with_shared_expert)
                    + (flops.global_flops_per_head(num_tokens, T, head_dim) if T else 0))
        T = num_tokens - h * w  # every other kind: the tokens off the grid are global
        if self.kind == 'agent':
            return flops.agent_flops_per_head((h, w), head_dim, (min(self.pool[0], h),
                                                                min(self.pool[1], w)), T)
        if self.kind == 'block':
            return flops.block_flops_per_head((h, w), head_dim, self.block_size,
                                              self.num_blocks, T)
        if self.kind == 'topk':
            return flops.topk_flops_per_head((h, w), head_dim, self.topk, T)
        return flops.window_flops_per_head((h, w), head_dim, self.window, T)

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
        """The spelling :meth:`parse` reads (``7:49``, ``4x6:16``, ``7:49:route``,
        ``agent:7``, ``block:8:4``...); a ``router_topk`` or ``shared_scale`` off its
        default, which the spelling has no place for, follows as ``key=value``."""
        ph, pw = self.pool
        pool = f'{ph}' if ph == pw else f'{ph}x{pw}'
        if self.kind != 'mita':
            values = {'agent': pool, 'block': f'{self.block_size}:{self.num_blocks}',
                      'topk': f'{self.topk}', 'window': f'{self.window}'}[self.kind]
            return ' '.join([f'{self.kind}:{values}'] + _extras(self.cfg()))
        out = f'{pool}:{self.topk}' + ('' if self.with_shared_expert else ':route')
        return ' '.join([out] + _extras(self.cfg()))

    @property
    def label(self) -> str:
        """What tables, logs and plots show: ``M=7x7 k=49``, ``M=4x4 k=16 route-only``,
        ``agent M=7x7``, ``block 8x8 x4``, ``top-k k=49``, ``window 7x7``; a ``router_topk``
        or ``shared_scale`` off its default as ``key=value``."""
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
        if self.kind != 'mita':
            return self.label
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


# The default setting (MiTA, M = k = 49): what single keys go over where nothing else is.
DEFAULT_SETTING = MiTASetting()


def _example(kind: Kind) -> str:
    """A setting of ``kind`` as a user writes it (``agent:7``)."""
    return {'agent': 'agent:7', 'block': 'block:8:4', 'topk': 'topk:49',
            'window': 'window:7'}.get(kind.name, '7:49')


def _extras(cfg: Dict[str, Any]) -> list:
    """``router_topk``/``shared_scale`` of ``cfg`` off their defaults, as ``key=value``."""
    return [f'{k}={cfg[k]}' for k in ('router_topk', 'shared_scale')
            if k in cfg and cfg[k] != MITA_DEFAULTS[k]]


def label(setting: Union[MiTASetting, Dict[str, Any], None]) -> str:
    """The label of a setting, of a dict of settings (some may be missing, as in a plan's
    layer: only those given are shown) or of dense attention (None): ``dense``, ``M=7x7
    k=49``, ``M=4x4 k=16 route-only``, ``k=16``, ``agent M=7x7``, ``block 8x8 x4``,
    ``top-k k=49``, ``window 7x7``; MiTA's settings at their defaults are left out."""
    if setting is None:
        return DENSE
    cfg = setting.cfg() if isinstance(setting, MiTASetting) else setting
    kind = cfg.get('kind', 'mita')
    if kind == 'block':
        s = cfg.get('block_size', KIND_DEFAULTS['block_size'])
        return f'block {s}x{s} x{cfg.get("num_blocks", KIND_DEFAULTS["num_blocks"])}'
    if kind == 'window':
        s = cfg.get('window', KIND_DEFAULTS['window'])
        return f'window {s}x{s}'
    parts = {'agent': ['agent'], 'topk': ['top-k']}.get(kind, [])
    if 'pool_size' in cfg:
        ph, pw = pool_pair(cfg['pool_size'])
        parts.append(f'M={ph}x{pw}')
    if 'topk' in cfg:
        parts.append(f'k={cfg["topk"]}')
    if cfg.get('with_shared_expert') is False:
        parts.append('route-only')
    parts += _extras(cfg)
    return ' '.join(parts) or 'MiTA (defaults)'

