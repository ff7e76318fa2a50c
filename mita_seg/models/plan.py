"""A swap plan: one MiTA setting (or dense attention) per attention layer, and its JSON file.

The one definition of the format ``--mita-plan PLAN.json`` reads, :func:`~mita_seg.swap_attention`
applies (``plan=``) and ``tools/calibrate_swap.py`` writes::

    {
      "format": "mita_seg.swap_plan/1",
      "layers": [
        {"name": "backbone.layers.0.attn", "setting": "dense"},
        {"name": "backbone.layers.1.attn",
         "setting": {"pool_size": 7, "topk": 49, "with_shared_expert": true}},
        ...
      ],
      ...                          (anything else: budget, FLOPs, calibration; kept, not read)
    }

``name`` is the attention module's name in the segmentor (as ``model.named_modules()`` gives
it; ``swap_attention`` swaps ``<owner>.layers.<i>.attn``); ``setting`` is ``"dense"`` (the
layer keeps softmax attention) or a setting of any kind as
:meth:`~mita_seg.setting.MiTASetting.cfg` writes it (``kind`` and the keys that kind reads;
MiTA's :data:`~mita_seg.models.MITA_KEYS` without ``kind``; those not given are the
defaults, a key the kind does not read an error). A layer entry may carry more keys
(``error``, ``gflops``: kept, not read), and the layer's shape in the model the plan was
made for, :data:`SHAPE_KEYS` (``"embed_dims": 192, "num_heads": 3``, what
:func:`attention_shape` reads off the module; ``tools/calibrate_swap.py`` writes them).
A plan names every swappable attention layer of its model: applied to a model with other
layers, or (where its entries give their shapes) with layers of another width or head
count, it is an error naming them and the model the plan was made for. A plan whose entries
give no shape (written before plans recorded them, or by hand) is checked by its layer
names only, and says so once in the log.
"""
import json
import logging
import os.path as osp
import re
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence

from mita_seg.setting import DENSE, SETTING_KEYS, MiTASetting, label

PLAN_FORMAT = 'mita_seg.swap_plan/1'
# what identifies a layer of the model a plan was made for (its entry's keys, ints >= 1)
SHAPE_KEYS = ('embed_dims', 'num_heads')
# what a layer name must look like: an attention module of a token owner's layers
_LAYER_NAME = re.compile(r'^([A-Za-z_][\w.]*\.)?layers\.(\d+)\.attn$')


class PlanError(ValueError):
    """A plan file that cannot be read or is malformed, or a plan that does not fit the
    model it is applied to (the message names the file, the layer and the fix)."""


def attention_shape(attn: Any) -> Dict[str, int]:
    """The shape of an attention module that a plan records and checks (:data:`SHAPE_KEYS`:
    its ``embed_dims`` and ``num_heads``, as mmcv's, mmseg's BEiT and the MiTA modules hold
    them); the keys a module does not have are left out.

    Args:
        attn (nn.Module): an attention module (standard or swapped).

    Returns:
        dict: ``{'embed_dims': C, 'num_heads': H}``, or the part of it the module has.
    """
    out = {}
    for key in SHAPE_KEYS:
        value = getattr(attn, key, None)
        if isinstance(value, int) and not isinstance(value, bool):
            out[key] = value
    return out


@dataclass
class SwapPlan:
    """Per-layer swap settings.

    Attributes:
        layers (dict): attention layer name -> its
            :class:`~mita_seg.setting.MiTASetting`, or None for dense attention; in the
            model's order.
        info (dict): the rest of the file (budget, FLOPs, calibration...), and per layer
            the entries' further keys under ``info['layer_info'][name]``.
        source (str): where the plan was read from (for messages). Default: ''.
    """
    layers: Dict[str, Optional[MiTASetting]]
    info: Dict[str, Any] = field(default_factory=dict)
    source: str = ''
    # whether check_fits has logged that the plan records no shapes (once a plan)
    _noted_unchecked: bool = field(default=False, repr=False, compare=False)

    @property
    def what(self) -> str:
        return f'plan {self.source}' if self.source else 'the plan'

    @classmethod
    def from_dict(cls, data: Any, source: str = '') -> 'SwapPlan':
        """Read and check a plan's JSON contents.

        Raises:
            PlanError: not a plan, an unknown format, a layer name that is not an attention
                layer (``<owner>.layers.<i>.attn``) or given twice, a bad setting.
        """
        what = f'plan {source}' if source else 'plan'
        if not isinstance(data, dict) or 'layers' not in data:
            raise PlanError(f'{what}: not a swap plan (a JSON object with "format": '
                            f'"{PLAN_FORMAT}" and "layers"); write one with '
                            'tools/calibrate_swap.py')
        if data.get('format') != PLAN_FORMAT:
            raise PlanError(f'{what}: format {data.get("format")!r} is not {PLAN_FORMAT!r}')
        entries = data['layers']
        if not isinstance(entries, list) or not entries:
            raise PlanError(f'{what}: "layers" must be a non-empty list of '
                            '{"name": ..., "setting": ...}')
        layers: Dict[str, Optional[MiTASetting]] = {}
        layer_info: Dict[str, Dict[str, Any]] = {}
        for n, entry in enumerate(entries):
            if not isinstance(entry, dict) or 'name' not in entry or 'setting' not in entry:
                raise PlanError(f'{what}: layer entry {n} must be an object with "name" and '
                                f'"setting", got {entry!r}')
            name, setting = entry['name'], entry['setting']
            if not isinstance(name, str) or not _LAYER_NAME.match(name):
                raise PlanError(f'{what}: unknown layer {name!r} (entry {n}): a layer is an '
                                'attention module <owner>.layers.<i>.attn, e.g. '
                                'backbone.layers.0.attn')
            if name in layers:
                raise PlanError(f'{what}: layer {name} is given twice')
            if setting == DENSE:
                setting = None
            elif isinstance(setting, dict):
                try:
                    setting = MiTASetting.from_cfg(setting)
                except ValueError as e:
                    raise PlanError(f'{what}: layer {name}: {e}') from None
            else:
                raise PlanError(f'{what}: layer {name}: setting must be "dense" or an object '
                                f'of settings ({", ".join(SETTING_KEYS)}), got {setting!r}')
            for key in SHAPE_KEYS:
                value = entry.get(key)
                if key in entry and (not isinstance(value, int) or isinstance(value, bool)
                                     or value < 1):
                    raise PlanError(f'{what}: layer {name}: {key} must be an int >= 1 (the '
                                    f'layer\'s {key} in the model the plan was made for), got '
                                    f'{value!r}; remove it to check the plan by its layer '
                                    'names only')
            layers[name] = setting
            layer_info[name] = {k: v for k, v in entry.items() if k not in ('name', 'setting')}
        info = {k: v for k, v in data.items() if k not in ('format', 'layers')}
        info['layer_info'] = layer_info
        return cls(layers, info, source)

    @classmethod
    def load(cls, path: str) -> 'SwapPlan':
        """Read a plan file (:meth:`from_dict`).

        Raises:
            PlanError: the file is missing, not JSON, or not a valid plan.
        """
        if not osp.isfile(path):
            raise PlanError(f'plan {path} not found')
        try:
            with open(path) as f:
                data = json.load(f)
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise PlanError(f'plan {path}: not a JSON file ({e})') from None
        return cls.from_dict(data, source=path)

    @classmethod
    def uniform(cls, names: Sequence[str], setting: Optional[MiTASetting]) -> 'SwapPlan':
        """The plan of one setting (None: dense) on every layer of ``names``."""
        return cls({n: setting for n in names})

    def to_dict(self) -> Dict[str, Any]:
        """The JSON contents (:meth:`from_dict` reads them back)."""
        info = dict(self.info)
        layer_info = info.pop('layer_info', {})
        layers = [dict(name=n, setting=DENSE if s is None else s.cfg(),
                       **layer_info.get(n, {})) for n, s in self.layers.items()]
        return dict(format=PLAN_FORMAT, layers=layers, **info)

    def save(self, path: str) -> str:
        """Write the plan as JSON, atomically (the old file or the new one, never half)."""
        from mita_seg.utils.atomic_files import atomic_write_text
        atomic_write_text(json.dumps(self.to_dict(), indent=2) + '\n', path)
        return path

    def check_fits(self, names: Sequence[str], model: str = 'the model',
                   shapes: Optional[Dict[str, Dict[str, int]]] = None,
                   config: Optional[str] = None) -> None:
        """Check that the plan names exactly the attention layers ``names`` of a model and,
        where its entries record their shapes (:data:`SHAPE_KEYS`), that the model's layers
        have those shapes: a plan made for another model (another width or head count, as
        ViT-T's plan on ViT-B, with the same layer names) is refused. A plan that records no
        shape (written before plans recorded them, or by hand) is checked by its names only,
        and, read from a file, says so once in the log.

        Args:
            names (Sequence[str]): the model's attention layers, in its order.
            model (str): the model, for messages. Default: 'the model'.
            shapes (dict, optional): each layer's :func:`attention_shape` in the model; None:
                the names only. Default: None.
            config (str, optional): the model's config, for messages. Default: None.

        Raises:
            PlanError: another layer count (a plan for another model), a layer the model
                does not have, or one of another shape than the plan records (the message
                names the model the plan was made for, and this one).
        """
        have, want = list(names), list(self.layers)
        if len(have) != len(want):
            raise PlanError(
                f'{self.what} is for a model with {len(want)} attention layers; {model} has '
                f'{len(have)} ({_span(have)}): a plan for another model? Calibrate one for '
                'this model with tools/calibrate_swap.py')
        unknown = [n for n in want if n not in have]
        if unknown:
            raise PlanError(f'{self.what} names layer {unknown[0]}, which {model} does not '
                            f'have (its attention layers: {_span(have)})')
        if shapes is None:
            return
        recorded = self.shapes()
        if not recorded:
            if self.source and not self._noted_unchecked:
                from mmengine.logging import print_log
                made_for = f' (made for {self.made_for})' if self.made_for else ''
                print_log(f'{self.what}{made_for} records no shapes of its layers (written '
                          'before plans recorded them, or by hand): checked against '
                          f'{model} by its layer names only. Calibrate it again '
                          '(tools/calibrate_swap.py) to have it checked', logger='current',
                          level=logging.WARNING)
                self._noted_unchecked = True
            return
        for name in want:
            planned, actual = recorded.get(name, {}), shapes.get(name, {})
            if any(k in planned and k in actual and planned[k] != actual[k]
                   for k in SHAPE_KEYS):
                keys = [k for k in SHAPE_KEYS if k in planned and k in actual]
                ours = f'{model} ({osp.basename(config)})' if config else model
                raise PlanError(
                    f'{self.what} was made for {self.made_for or "another model"}, whose '
                    f'{name} has '
                    f'{_shape_text(planned, keys)}; in {ours} it has '
                    f'{_shape_text(actual, keys)}: a plan for another model. Calibrate one '
                    'for this model with tools/calibrate_swap.py')

    def shapes(self) -> Dict[str, Dict[str, int]]:
        """The layers' shapes in the model the plan was made for, where its entries record
        them (:data:`SHAPE_KEYS`): name -> ``{'embed_dims': C, 'num_heads': H}``."""
        out = {}
        for name in self.layers:
            li = self.info.get('layer_info', {}).get(name, {})
            shape = {k: li[k] for k in SHAPE_KEYS if k in li}
            if shape:
                out[name] = shape
        return out

    @property
    def made_for(self) -> Optional[str]:
        """The config of the model the plan was made for, as the plan records it
        (``model.config``); None where it records none."""
        model = self.info.get('model')
        config = model.get('config') if isinstance(model, dict) else None
        return str(config) if config else None

    def owner_settings(self, owner: str, num_layers: int) -> List[Optional[Dict[str, Any]]]:
        """The settings of ``<owner>.layers.<i>.attn`` for ``i < num_layers`` as dicts (None:
        dense), as a MiTA backbone's or head's ``mita_layer_cfgs``."""
        settings = [self.layers.get(f'{owner}.layers.{i}.attn') for i in range(num_layers)]
        return [None if s is None else s.cfg() for s in settings]

    def owners(self) -> List[str]:
        """The token owners (``backbone``, ``decode_head``) the plan's layers belong to."""
        out: List[str] = []
        for name in self.layers:
            owner = (_LAYER_NAME.match(name).group(1) or '').rstrip('.')
            if owner not in out:
                out.append(owner)
        return out

    def describe(self) -> str:
        """The layers grouped by setting (:attr:`~mita_seg.setting.MiTASetting.label`):
        ``M=4x4 k=16: backbone.layers.0-3.attn, decode_head.layers.0-1.attn; dense: ...``."""
        groups: Dict[str, List[str]] = {}
        for name, setting in self.layers.items():
            groups.setdefault(label(setting), []).append(name)
        return '; '.join(f'{text}: {_span(names)}' for text, names in groups.items())

    def swapped_as(self) -> str:
        """What its swapped layers run, by kind: ``MiTA``, ``agent``, ``MiTA, block``."""
        names = [s.swap_name for s in self.layers.values() if s is not None]
        return ', '.join(dict.fromkeys(names)) or 'none'

    def summary(self) -> str:
        """``14 layers: 9 on MiTA, 5 dense``; each kind by its name (``5 on MiTA, 2 on
        agent, 3 dense``)."""
        counts: Dict[str, int] = {}
        for s in self.layers.values():
            name = 'dense' if s is None else f'on {s.swap_name}'
            counts[name] = counts.get(name, 0) + 1
        dense = counts.pop('dense', 0)
        on = ', '.join(f'{n} {name}' for name, n in counts.items()) or '0 on MiTA'
        return f'{len(self.layers)} layers: {on}, {dense} dense'


def _shape_text(shape: Dict[str, int], keys: Sequence[str]) -> str:
    """``embed_dims 192 and num_heads 3``: the ``keys`` of a layer's shape."""
    return ' and '.join(f'{k} {shape[k]}' for k in keys)


def _span(names: Sequence[str]) -> str:
    """``backbone.layers.0-3.attn, decode_head.layers.0-1.attn``: names grouped by owner."""
    groups: Dict[str, List[int]] = {}
    for n in names:
        m = _LAYER_NAME.match(n)
        if m is None:
            groups.setdefault(n, [])
        else:
            groups.setdefault(m.group(1) or '', []).append(int(m.group(2)))
    parts = []
    for owner, ids in groups.items():
        if not ids:
            parts.append(owner)
        elif ids == list(range(ids[0], ids[-1] + 1)) and len(ids) > 1:
            parts.append(f'{owner}layers.{ids[0]}-{ids[-1]}.attn')
        else:
            parts.append(', '.join(f'{owner}layers.{i}.attn' for i in ids))
    return ', '.join(parts) or 'none'
