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
:meth:`~MiTASetting.attention_macs` is its cost. A setting is checked when it is made, and
travels whole from the command line to the operator; a key that its kind does not read is an
error. Each kind is one :class:`Kind` record in :data:`KINDS`.
"""
import dataclasses
import itertools
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, fields
from numbers import Integral, Real
from typing import Any, Callable, Dict, Iterable, Iterator, Optional, Tuple, Union

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
# the settings the spelling has no place for: written and read after it as ``key=value``
UNSPELT_KEYS = ('router_topk', 'shared_scale')
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
    'shared_scale': ('a finite number > 0, or None for 1/d',
                     lambda x: x is None or (isinstance(x, Real) and not isinstance(x, bool)
                                             and 0 < x < math.inf)),
    'with_dwc': ('True or False', lambda x: isinstance(x, bool)),
    'block_size': ('an int >= 1 (blocks of block_size x block_size grid tokens)',
                   lambda x: _is_int(x) and x >= 1),
    'num_blocks': ('an int >= 1', lambda x: _is_int(x) and x >= 1),
    'window': ('an int >= 1 (a window x window neighbourhood)', lambda x: _is_int(x) and x >= 1),
}


@dataclass(frozen=True)
class Kind:
    """One kind of attention a setting can choose: everything the project knows of it, in
    one record (as :data:`mita_seg.ops.dispatch.BACKENDS` holds the backends). A new kind is
    an operator module in :mod:`mita_seg.ops` and one record here.

    Attributes:
        name (str): what ``kind`` says (``'mita'``, ``'agent'``...).
        keys (tuple[str]): the settings it reads; giving it another one is an error.
        spelling (str): how a user writes it (``agent:P``).
        pattern (str): the regular expression of the spelling; its groups are ``keys``'
            values, in order (a ``PhxPw`` pool: two groups; MiTA's ``:route``).
        example (str): a setting as a user writes it (``agent:7``).
        title (str): the family it stands for, in words.
        operator (str): ``module:function`` of :mod:`mita_seg.ops` that runs it,
            ``fn(setting, q, k, v, hw_shape, num_prefix_tokens, global_tokens,
            rel_pos_bias)`` (:func:`mita_seg.ops.attend`).
        values (callable): ``setting -> str``, the spelling (without ``key=value`` extras).
        label (callable): ``dict of settings -> list[str]``, the words of its label (keys
            missing from the dict are left out, as in a plan's layer).
        macs (callable): ``(setting, (h, w), N, d, T) -> int``, multiply-adds per batch item
            and head over ``N`` tokens of which the ``h x w`` grid and ``T`` global ones
            (:mod:`mita_seg.ops.flops`).
        fit (callable): ``(setting, (h, w), n) -> setting``, the setting as it runs on an
            ``h x w`` grid with ``n`` keys (a pool, ``k`` larger than those clamped).
        candidates (callable): ``(h, w) -> Iterator[setting]``, the settings worth pricing
            on that grid (:mod:`mita_seg.analysis.equal_cost`: a kind at a given cost).
        bias_adds (callable, optional): ``(setting, (h, w), N, T) -> int``, the additions of
            a relative position bias (BEiT's) per batch item and head, as ``macs``; None for
            a kind that takes no bias (its operator refuses one).
    """
    name: str
    keys: Tuple[str, ...]
    spelling: str
    pattern: str
    example: str
    title: str
    operator: str
    values: Callable[['MiTASetting'], str]
    label: Callable[[Dict[str, Any]], list]
    macs: Callable[..., int]
    fit: Callable[..., 'MiTASetting']
    candidates: Callable[[Tuple[int, int]], Iterator['MiTASetting']]
    bias_adds: Optional[Callable[..., int]] = None

    def read(self, m: 're.Match') -> Dict[str, Any]:
        """The settings of a match of :attr:`pattern` (a ``PhxPw`` pool as a pair)."""
        groups = list(m.groups())
        out: Dict[str, Any] = {}
        for key in self.keys:
            if not groups:
                break
            if key == 'pool_size':
                ph, pw = groups.pop(0), groups.pop(0)
                out[key] = int(ph) if pw is None else (int(ph), int(pw))
            elif key == 'with_shared_expert':
                out[key] = groups.pop(0) is None      # ':route' given: route-only
            elif key not in UNSPELT_KEYS:
                out[key] = int(groups.pop(0))
        return out


def _pool_text(s: 'MiTASetting') -> str:
    ph, pw = s.pool
    return f'{ph}' if ph == pw else f'{ph}x{pw}'


def _pool_words(cfg: Dict[str, Any]) -> list:
    if 'pool_size' not in cfg:
        return []
    ph, pw = pool_pair(cfg['pool_size'])
    return [f'M={ph}x{pw}']


def _side(cfg: Dict[str, Any], key: str) -> int:
    return cfg.get(key, KIND_DEFAULTS[key])


def _clamped_pool(s: 'MiTASetting', hw: Tuple[int, int]) -> Tuple[int, int]:
    return min(s.pool[0], hw[0]), min(s.pool[1], hw[1])


def _flops(name: str) -> Callable[..., int]:
    """``mita_seg.ops.flops.<name>`` (imported when called: this module loads no torch)."""
    def macs(*args):
        from mita_seg.ops import flops
        return getattr(flops, name)(*args)
    return macs


def _mita_macs(s, hw, n, d, t):
    ph, pw = _clamped_pool(s, hw)
    m = ph * pw
    return (_flops('mita_flops_per_head')(n - t, d, m, min(s.topk, n - t),
                                          min(s.router_topk, m), s.with_shared_expert)
            + (_flops('global_flops_per_head')(n, t, d) if t else 0))


def _mita_bias_adds(s, hw, n, t):
    ph, pw = _clamped_pool(s, hw)
    return _flops('bias_flops_per_head')(n - t, ph * pw, min(s.topk, n - t),
                                         min(s.router_topk, ph * pw))


def _mita_fit(s, hw, n):
    pool = _clamped_pool(s, hw)
    fitted = (pool, min(s.topk, n), min(s.router_topk, pool[0] * pool[1]))
    if fitted == (s.pool, s.topk, s.router_topk):
        return s                                    # runs as asked: no new setting
    return dataclasses.replace(s, pool_size=pool, topk=fitted[1], router_topk=fitted[2])


def _mita_candidates(grid):
    h, w = grid
    return (MiTASetting(pool_size=p, topk=k)
            for p, k in itertools.product(range(1, min(h, w) + 1), MITA_TOPKS) if k <= h * w)


def _agent_candidates(grid):
    side = min(grid)
    for p in range(1, side + 1):
        yield MiTASetting(kind='agent', pool_size=p)
        if p < side:
            yield MiTASetting(kind='agent', pool_size=(p, p + 1))


def _block_candidates(grid):
    h, w = grid
    for b in range(2, max(h, w) + 1):
        blocks = math.ceil(h / b) * math.ceil(w / b)
        yield from (MiTASetting(kind='block', block_size=b, num_blocks=n)
                    for n in range(1, blocks + 1))


def _as_is(s, hw, n):
    return s


# MiTA's top-k values priced at a given cost (the pool sizes are every side up to the grid's)
MITA_TOPKS = (4, 8, 16, 32, 49, 64, 100, 128, 256)

# The kinds, in the paper's taxonomy: MiTA, compression only, block routing, per-query top-k,
# and a local window (what the attention of a token sees when it cannot reach far). Every
# kind but MiTA treats the tokens off the patch grid as global (its T = N - h w).
KINDS: Dict[str, Kind] = {k.name: k for k in (
    Kind('mita', MITA_KEYS, 'P:K, PhxPw:K or P:K:route', r'^(\d+)(?:x(\d+))?:(\d+)(:route)?$',
         '7:49', 'MiTA (landmarks, shared and routed top-k experts)',
         'mita_seg.ops.mita:attend_setting',
         values=lambda s: (f'{_pool_text(s)}:{s.topk}'
                           + ('' if s.with_shared_expert else ':route')),
         label=lambda c: (_pool_words(c) + ([f'k={c["topk"]}'] if 'topk' in c else [])
                          + (['route-only'] if c.get('with_shared_expert') is False else [])),
         macs=_mita_macs, fit=_mita_fit, candidates=_mita_candidates,
         bias_adds=_mita_bias_adds),
    Kind('agent', ('pool_size', 'shared_scale'), 'agent:P or agent:PhxPw',
         r'^agent:(\d+)(?:x(\d+))?$', 'agent:7',
         "compression only (Agent Attention: MiTA's shared expert alone)",
         'mita_seg.ops.agent:attend_setting', values=lambda s: f'agent:{_pool_text(s)}',
         label=lambda c: ['agent'] + _pool_words(c),
         macs=lambda s, hw, n, d, t: _flops('agent_flops_per_head')(
             hw, d, _clamped_pool(s, hw), n - hw[0] * hw[1]),
         fit=lambda s, hw, n: dataclasses.replace(s, pool_size=_clamped_pool(s, hw)),
         candidates=_agent_candidates),
    Kind('block', ('block_size', 'num_blocks'), 'block:S:B', r'^block:(\d+):(\d+)$',
         'block:8:4', 'block routing (MoBA: S x S-token blocks, B per query)',
         'mita_seg.ops.block:attend_setting',
         values=lambda s: f'block:{s.block_size}:{s.num_blocks}',
         label=lambda c: [f'block {_side(c, "block_size")}x{_side(c, "block_size")} '
                          f'x{_side(c, "num_blocks")}'],
         macs=lambda s, hw, n, d, t: _flops('block_flops_per_head')(
             hw, d, s.block_size, s.num_blocks, n - hw[0] * hw[1]),
         fit=_as_is, candidates=_block_candidates),
    Kind('topk', ('topk', ), 'topk:K', r'^topk:(\d+)$', 'topk:49', 'per-query top-k keys',
         'mita_seg.ops.topk:attend_setting', values=lambda s: f'topk:{s.topk}',
         label=lambda c: ['top-k'] + ([f'k={c["topk"]}'] if 'topk' in c else []),
         macs=lambda s, hw, n, d, t: _flops('topk_flops_per_head')(
             hw, d, s.topk, n - hw[0] * hw[1]),
         fit=_as_is,
         candidates=lambda g: (MiTASetting(kind='topk', topk=k)
                               for k in range(1, g[0] * g[1] + 1)),
         bias_adds=lambda s, hw, n, t: _flops('topk_bias_adds_per_head')(
             hw, s.topk, n - hw[0] * hw[1])),
    Kind('window', ('window', ), 'window:W', r'^window:(\d+)$', 'window:7',
         'a local W x W window (neighbourhood attention)',
         'mita_seg.ops.window:attend_setting', values=lambda s: f'window:{s.window}',
         label=lambda c: [f'window {_side(c, "window")}x{_side(c, "window")}'],
         macs=lambda s, hw, n, d, t: _flops('window_flops_per_head')(
             hw, d, s.window, n - hw[0] * hw[1]),
         fit=_as_is,
         candidates=lambda g: (MiTASetting(kind='window', window=s)
                               for s in range(1, max(g) + 1)),
         bias_adds=lambda s, hw, n, t: _flops('window_bias_adds_per_head')(
             hw, s.window, n - hw[0] * hw[1])),
)}
# MiTA's kind, and the kinds of the taxonomy beside it.
MITA = 'mita'
OTHER_KINDS: Tuple[str, ...] = tuple(k for k in KINDS if k != MITA)
# the kinds that take a relative position bias (BEiT's attention runs these)
BIAS_KINDS: Tuple[str, ...] = tuple(k for k, r in KINDS.items() if r.bias_adds is not None)
SETTING_RULES['kind'] = (f"one of {', '.join(repr(k) for k in KINDS)}",
                         lambda x: isinstance(x, str) and x in KINDS)


class MiTASettingError(ValueError):
    """A MiTA setting (or a layer choice) that cannot be used: an unknown name, a bad value,
    a key its kind does not read, ``router_topk`` above the number of landmarks, a layer the
    model does not have, a setting spelled wrong."""


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
            (the message says what the value must be), a key that the ``kind`` given does
            not read, or ``router_topk`` above the ``M = Ph * Pw`` landmarks of
            ``pool_size`` given with it.
    """
    rules = SETTING_RULES if rules is None else rules
    for key, value in settings.items():
        if key not in rules:
            raise MiTASettingError(f'unknown MiTA setting {key!r}; allowed: '
                                   + ', '.join(f'{k} ({rules[k][0]})' for k in rules))
        what, ok = rules[key]
        if not ok(value):
            hint = ''
            if (isinstance(value, Integral) and not isinstance(value, (int, bool))
                    and ok(int(value))):
                hint = f' (a {type(value).__name__}: give a Python int, int({key}))'
            raise MiTASettingError(f'{key}={value!r}: {key} must be {what}{hint}')
    if 'kind' in settings:
        check_kind_keys(settings['kind'], settings)
    if 'pool_size' in settings and 'router_topk' in settings:
        ph, pw = pool_pair(settings['pool_size'])
        if settings['router_topk'] > ph * pw:
            raise MiTASettingError(
                f"router_topk={settings['router_topk']} is more than the M={ph * pw} "
                f"landmarks (experts) of pool_size={settings['pool_size']}: a query reads at "
                f'most M experts; give router_topk <= {ph * pw} or a larger pool_size')
    return settings


def check_kind_keys(kind: str, keys: Iterable[str]) -> None:
    """Refuse a setting key that ``kind`` does not read (``topk`` for ``agent``).

    Raises:
        MiTASettingError: one line naming the key and the kind, and the keys it reads.
    """
    record = KINDS[kind]
    unused = [k for k in keys if k in SETTING_KEYS and k != 'kind' and k not in record.keys]
    if unused:
        raise MiTASettingError(
            f'{unused[0]} is not a setting of {kind} attention ({record.example} reads '
            f'{", ".join(record.keys)}): leave {unused[0]} out, or give a kind that reads it')


@dataclass(frozen=True)
class MiTASetting:
    """One attention setting (what a swapped attention module computes): MiTA's, or another
    kind's (:data:`KINDS`), checked when it is made. Layers, plans and tools pass this object
    whole, from the command line to the operator (:func:`mita_seg.ops.attend`).

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
        MiTASettingError: a bad value (:func:`check_settings`), or a key off its default
            that the kind does not read.
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
        given = {f.name: getattr(self, f.name) for f in fields(self)}
        check_settings({k: v for k, v in given.items() if k != 'kind'})
        check_settings({'kind': self.kind})
        off = [k for k, v in given.items() if k != 'kind' and (
            pool_pair(v) != pool_pair(SETTING_DEFAULTS[k]) if k == 'pool_size'
            else v != SETTING_DEFAULTS[k])]
        check_kind_keys(self.kind, off)
        ph, pw = pool_pair(self.pool_size)
        object.__setattr__(self, 'pool_size', ph if ph == pw else (ph, pw))

    @property
    def record(self) -> Kind:
        """The record of its kind (:data:`KINDS`)."""
        return KINDS[self.kind]

    @property
    def is_mita(self) -> bool:
        """Whether it is MiTA (not another kind of the taxonomy)."""
        return self.kind == MITA

    @classmethod
    def parse(cls, text: str) -> 'MiTASetting':
        """The setting a user typed: MiTA's ``P:K``, ``PhxPw:K``, with ``:route`` for
        route-only (``7:49``, ``4x6:16``, ``7:49:route``), or another kind's spelling
        (``agent:7``, ``block:8:4``, ``topk:49``, ``window:7``), followed by the
        ``router_topk``/``shared_scale`` :attr:`text` writes as ``key=value``
        (``7:49 router_topk=2``).

        Raises:
            MiTASettingError: anything else (the message names the text and shows the
                spelling; the old ``7,49`` is shown as ``7:49``).
        """
        head, *extras = text.split() if isinstance(text, str) and text.strip() else ['']
        kind = KINDS.get(head.split(':')[0], KINDS[MITA])
        m = re.match(kind.pattern, head)
        if m is not None and min(int(v) for v in m.groups() if v and v.isdigit()) >= 1:
            return cls(kind=kind.name, **kind.read(m), **_read_extras(text, extras))
        if kind.name != MITA:
            raise MiTASettingError(f'{kind.name} setting {text!r}: write {kind.spelling} '
                                   f'(positive integers), e.g. {kind.example}')
        hint = ''
        if isinstance(text, str) and re.match(r'^\d+(,\d+)+$', text.strip()):
            parts = text.strip().split(',')
            hint = f' ({text!r} is the old spelling: write {":".join(parts[:2])})'
        others = ', '.join(k.example for k in KINDS.values() if k.name != MITA)
        raise MiTASettingError(
            f'MiTA setting {text!r}: write P:K (pool P x P, top-k K, shared expert), '
            f'PhxPw:K (a Ph x Pw pool) or P:K:route (route-only), e.g. {EXAMPLES}{hint}; '
            f'or another kind: {others}')

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
        check_settings({'kind': MITA, **cfg}, {k: SETTING_RULES[k] for k in SETTING_KEYS})
        return cls(**cfg)

    @classmethod
    def of(cls, setting: Union['MiTASetting', str, Dict[str, Any], None]
           ) -> Optional['MiTASetting']:
        """A setting as the APIs take it: a :class:`MiTASetting`, its text (:meth:`parse`,
        ``'7:49'``) or a dict of settings (:meth:`from_cfg`, ``dict(pool_size=7,
        topk=49)``); None stays None.

        Raises:
            MiTASettingError: anything else, or a text or dict that is not a setting.
        """
        if setting is None or isinstance(setting, cls):
            return setting
        if isinstance(setting, str):
            return cls.parse(setting)
        if isinstance(setting, Mapping):
            return cls.from_cfg(dict(setting))
        raise MiTASettingError(
            f'a setting is a MiTASetting, its text (e.g. {EXAMPLES}) or a dict of settings '
            f'(e.g. dict(pool_size=7, topk=49)), not {type(setting).__name__} {setting!r}')

    def replace(self, **settings) -> 'MiTASetting':
        """This setting with some keys (:data:`SETTING_KEYS`) changed, e.g. ``topk=16``; with
        another ``kind``, that kind's setting: the keys both kinds read kept (``4:16`` with
        ``kind='agent'`` is ``agent:4``), the keys given over them, the rest the defaults.

        Raises:
            MiTASettingError: an unknown key, a bad value, or a key the kind does not read.
        """
        kind = settings.get('kind', self.kind)
        if kind != self.kind:
            if not SETTING_RULES['kind'][1](kind):
                check_settings({'kind': kind})
            kept = {k: getattr(self, k) for k in self.record.keys if k in KINDS[kind].keys}
            return MiTASetting.from_cfg({**kept, **settings})
        check_settings({'kind': self.kind, **settings},
                       {k: SETTING_RULES[k] for k in SETTING_KEYS})
        return dataclasses.replace(self, **settings)

    def cfg(self) -> Dict[str, Any]:
        """The settings as a dict (``swap_attention(model, **s.cfg())``,
        ``MiTAAttention.configure(**s.cfg())``, a config's ``mita_cfg``, a plan's layer):
        every key of :data:`MITA_KEYS` for MiTA, ``kind`` and the keys it reads for another
        kind."""
        head = {} if self.is_mita else {'kind': self.kind}
        return {**head, **{k: getattr(self, k) for k in self.record.keys}}

    def attention_macs(self, hw_shape: Tuple[int, int], num_tokens: int, head_dim: int,
                       num_global_tokens: int = 0) -> int:
        """Multiply-adds of this attention per batch item and head (one MAC = one FLOP),
        over ``num_tokens`` tokens of which the ``h x w`` grid and ``num_global_tokens``
        global ones (MiTA's; every other kind takes the tokens off the grid as global), as
        the module runs it (a pool, k or window larger than the grid clamped to it): the
        formulas of :mod:`mita_seg.ops.flops`."""
        return self.record.macs(self, tuple(hw_shape), num_tokens, head_dim,
                                num_global_tokens)

    def bias_adds(self, hw_shape: Tuple[int, int], num_tokens: int,
                  num_global_tokens: int = 0) -> int:
        """Additions of a relative position bias (BEiT's) in this attention per batch item
        and head, counted as :meth:`attention_macs` (one add = one FLOP).

        Raises:
            MiTASettingError: the kind takes no bias (``Kind.bias_adds`` None).
        """
        if self.record.bias_adds is None:
            raise MiTASettingError(f'{self.record.title} does not take a relative position '
                                   'bias')
        return self.record.bias_adds(self, tuple(hw_shape), num_tokens, num_global_tokens)

    def fit(self, hw_shape: Tuple[int, int], num_keys: int) -> 'MiTASetting':
        """This setting as it runs on an ``h x w`` grid with ``num_keys`` keys: a pool
        larger than the grid on the grid, ``k`` at most the keys, ``router_topk`` at most
        ``M`` (as mmseg's ViT runs on any image of at least one patch)."""
        return self.record.fit(self, tuple(hw_shape), num_keys)

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
        return ' '.join([self.record.values(self)] + _extras(self.cfg()))

    @property
    def label(self) -> str:
        """What tables, logs and plots show: ``M=7x7 k=49``, ``M=4x4 k=16 route-only``,
        ``agent M=7x7``, ``block 8x8 x4``, ``top-k k=49``, ``window 7x7``; a ``router_topk``
        or ``shared_scale`` off its default as ``key=value``."""
        return label(self)

    @property
    def swap_name(self) -> str:
        """What a layer swapped to it is called in tools' lines and columns: ``MiTA``, or
        the kind's name (``agent``, ``window``...)."""
        return 'MiTA' if self.is_mita else self.kind

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
        if not self.is_mita:
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


def _extras(cfg: Dict[str, Any]) -> list:
    """``router_topk``/``shared_scale`` of ``cfg`` off their defaults, as ``key=value``."""
    return [f'{k}={cfg[k]}' for k in UNSPELT_KEYS if k in cfg and cfg[k] != MITA_DEFAULTS[k]]


def _read_extras(text: str, extras: Iterable[str]) -> Dict[str, Any]:
    """The ``key=value`` words :func:`_extras` writes after a spelling (``router_topk=2``,
    ``shared_scale=0.125``), as settings.

    Raises:
        MiTASettingError: a word that is not one of them, or a value that is no number.
    """
    out = {}
    for word in extras:
        key, _, value = word.partition('=')
        if key not in UNSPELT_KEYS or not value:
            raise MiTASettingError(f'setting {text!r}: {word!r} is not key=value of '
                                   f'{" or ".join(UNSPELT_KEYS)} (e.g. 7:49 router_topk=2)')
        try:
            out[key] = int(value) if key == 'router_topk' else (
                None if value == 'None' else float(value))
        except ValueError:
            raise MiTASettingError(f'setting {text!r}: {key}={value} is not a number') from None
    return out


def label(setting: Union[MiTASetting, Dict[str, Any], None]) -> str:
    """The label of a setting, of a dict of settings (some may be missing, as in a plan's
    layer: only those given are shown) or of dense attention (None): ``dense``, ``M=7x7
    k=49``, ``M=4x4 k=16 route-only``, ``k=16``, ``agent M=7x7``, ``block 8x8 x4``,
    ``top-k k=49``, ``window 7x7``; MiTA's settings at their defaults are left out."""
    if setting is None:
        return DENSE
    cfg = setting.cfg() if isinstance(setting, MiTASetting) else setting
    parts = KINDS[cfg.get('kind', MITA)].label(cfg) + _extras(cfg)
    return ' '.join(parts) or 'MiTA (defaults)'
